"""torchfuse.recsys.data and .metrics against plain-Python references on random data."""
import math
import random

import pytest
import torch

from torchfuse.recsys import data, metrics


def _py_histories(h):
    return [h.items[h.offsets[u]:h.offsets[u + 1]].tolist() for u in range(h.num_users)]


@pytest.mark.parametrize("stride", [1, 1_000_003])
def test_synthetic_shapes_and_determinism(stride):
    U, N = random.randint(0, 40), random.randint(1, 300)
    lo = random.randint(1, 10)
    hi = lo + random.randint(0, 20)
    seed = random.randint(0, 2**31)
    h = data.synthetic_histories(U, N, min_len=lo, max_len=hi, id_stride=stride, seed=seed)
    assert h.num_users == U and h.items.dtype == torch.long
    assert bool(((h.lengths >= lo) & (h.lengths <= hi)).all())
    ranks = (h.items - 1) // stride
    assert bool(((h.items - 1) % stride == 0).all()) and bool(((ranks >= 0) & (ranks < N)).all())
    h2 = data.synthetic_histories(U, N, min_len=lo, max_len=hi, id_stride=stride, seed=seed)
    assert torch.equal(h.items, h2.items) and torch.equal(h.offsets, h2.offsets)


def test_synthetic_has_structure():
    """Next items concentrate on a few successors per item: the most frequent successor of an item
    follows it far more often than popularity alone would give, which is what a model can learn."""
    h = data.synthetic_histories(2000, 200, min_len=20, max_len=40, follow_prob=0.8, successors=4, seed=1)
    pairs = {}
    for seq in _py_histories(h):
        for a, b in zip(seq, seq[1:]):
            pairs.setdefault(a, []).append(b)
    top4 = []
    for a, nxt in pairs.items():
        if len(nxt) >= 50:
            counts = sorted((nxt.count(x) for x in set(nxt)), reverse=True)
            top4.append(sum(counts[:4]) / len(nxt))
    # 80% follow one of 4 successors (plus popularity draws that land there); popularity alone puts
    # about 28% of draws on the 4 most popular of 200 Zipf(1.05) items
    assert len(top4) > 20 and sum(top4) / len(top4) > 0.75


def test_synthetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="min_len"):
        data.synthetic_histories(3, 10, min_len=5, max_len=4)
    with pytest.raises(ValueError, match="follow_prob"):
        data.synthetic_histories(3, 10, follow_prob=1.5)
    with pytest.raises(ValueError, match="num_items"):
        data.synthetic_histories(3, 0)


def _random_ratings(n_users, n_rows):
    rows = []
    for _ in range(n_rows):
        rows.append((random.randint(1, n_users) * 7, random.randint(1, 10**9), random.choice([1, 2.5, 3, 4, 5]),
                     random.randint(0, 20)))  # few timestamps: ties must keep file order
    return rows


def _expected(rows, min_rating=0.0):
    by_user = {}
    for n, (u, i, r, t) in enumerate(rows):
        if r >= min_rating:
            by_user.setdefault(u, []).append((t, n, i))
    users = sorted(by_user)
    return users, [[i for _, _, i in sorted(by_user[u])] for u in users]


@pytest.mark.parametrize("fmt", ["dat", "csv"])
def test_load_movielens(tmp_path, fmt):
    rows = _random_ratings(random.randint(1, 15), random.randint(1, 200))
    if fmt == "dat":
        path = tmp_path / "ratings.dat"
        path.write_text("".join(f"{u}::{i}::{int(r) if r == int(r) else r}::{t}\n" for u, i, r, t in rows))
    else:
        path = tmp_path / "ratings.csv"
        path.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows))
    for min_rating in (0.0, 3.0):
        users, hist = _expected(rows, min_rating)
        h = data.load_movielens(str(tmp_path), min_rating=min_rating)  # the directory form
        assert h.user_ids.tolist() == users
        assert _py_histories(h) == hist
        ts = [h.timestamps[h.offsets[u]:h.offsets[u + 1]].tolist() for u in range(h.num_users)]
        assert all(t == sorted(t) for t in ts)


def test_load_movielens_bad_files(tmp_path):
    (tmp_path / "ratings.csv").write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="header"):
        data.load_movielens(str(tmp_path / "ratings.csv"))
    (tmp_path / "ratings.dat").write_text("1::2::3::4\n1::x::3::5\n")
    with pytest.raises(ValueError, match="line 2"):
        data.load_movielens(str(tmp_path / "ratings.dat"))
    (tmp_path / "short.dat").write_text("1::2::3\n")
    with pytest.raises(ValueError, match="4 fields"):
        data.load_movielens(str(tmp_path / "short.dat"))
    with pytest.raises(FileNotFoundError):
        data.load_movielens(str(tmp_path / "nothing_here"))


def _random_histories():
    U = random.randint(0, 30)
    lengths = [random.choice([0, 1, 2, random.randint(0, 25)]) for _ in range(U)]
    items = torch.randint(0, 2**62, (sum(lengths),))
    offsets = torch.zeros(U + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    return data.Histories(items, offsets, torch.arange(U) * 3 + 5, torch.arange(sum(lengths)))


def test_leave_one_out():
    h = _random_histories()
    train, targets = data.leave_one_out(h)
    ref = [(int(h.user_ids[u]), s[:-1], s[-1]) for u, s in enumerate(_py_histories(h)) if len(s) >= 2]
    assert train.user_ids.tolist() == [r[0] for r in ref]
    assert _py_histories(train) == [r[1] for r in ref]
    assert targets.tolist() == [r[2] for r in ref]


def test_batches():
    h = _random_histories()
    max_len, bs = random.randint(1, 8), random.randint(1, 7)
    got = list(data.batches(h, bs, max_len=max_len, shuffle=False))
    ref = [(int(h.user_ids[u]), s[-(max_len + 1):]) for u, s in enumerate(_py_histories(h)) if len(s) >= 2]
    assert len(got) == math.ceil(len(ref) / bs)
    flat = []
    for b in got:
        assert b.max_len == int((b.offsets[1:] - b.offsets[:-1]).max())
        for k in range(b.user_ids.numel()):
            x = b.items[b.offsets[k]:b.offsets[k + 1]].tolist()
            y = b.targets[b.offsets[k]:b.offsets[k + 1]].tolist()
            flat.append((int(b.user_ids[k]), x, y))
    assert flat == [(u, w[:-1], w[1:]) for u, w in ref]
    g = torch.Generator().manual_seed(3)
    shuffled = list(data.batches(h, bs, max_len=max_len, generator=g, drop_last=True))
    assert len(shuffled) == len(ref) // bs
    seen = [u for b in shuffled for u in b.user_ids.tolist()]
    assert len(seen) == len(set(seen)) == len(shuffled) * bs and set(seen) <= {u for u, _ in ref}


def test_histories_rejects_bad_offsets():
    with pytest.raises(ValueError, match="non-decreasing"):
        data.Histories(torch.zeros(4, dtype=torch.long), torch.tensor([0, 3, 2, 4]), torch.arange(3))
    with pytest.raises(ValueError, match="end at"):
        data.Histories(torch.zeros(4, dtype=torch.long), torch.tensor([0, 3]), torch.arange(1))
    with pytest.raises(ValueError, match="user_ids"):
        data.Histories(torch.zeros(4, dtype=torch.long), torch.tensor([0, 4]), torch.arange(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_items_matches_full_topk(device, dtype):
    """Chunked top-k against one top-k over the full score matrix. A chunk's matmul may sum in another
    order than the full one (an ulp apart), which can swap two items whose scores lie within that
    rounding of each other: there the returned item must carry the rank's score; everywhere else it
    must be the reference's item."""
    B, N, D = random.randint(1, 9), random.randint(1, 500), random.randint(1, 40)
    k = random.randint(1, N)
    q = torch.randn(B, D, device=device, dtype=dtype)
    items = torch.randn(N, D, device=device, dtype=dtype)
    full = (q @ items.t()).float()
    ref_s, ref_i = torch.topk(full, k, dim=1)
    rtol, atol = (1.3e-6, 1e-5) if dtype == torch.float32 else (1e-7, 1e-7)
    # a rank is tied when another item's score lies within the tolerance of the rank's score
    near = (full.unsqueeze(1) - ref_s.unsqueeze(2)).abs() <= atol + rtol * ref_s.abs().unsqueeze(2)
    tied = near.sum(2) > 1
    for chunk in (1, random.randint(1, N), N, N + 5):
        s, i = metrics.topk_items(q, items, k, chunk_size=chunk)
        torch.testing.assert_close(s, ref_s, rtol=rtol, atol=atol)
        torch.testing.assert_close(full.gather(1, i), ref_s, rtol=rtol, atol=atol)
        assert all(len(set(row)) == len(row) for row in i.tolist()), "an item returned twice"
        assert torch.equal(i[~tied], ref_i[~tied]), f"chunk {chunk}: an untied rank's item differs"


def test_topk_items_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        metrics.topk_items(torch.randn(2, 4), torch.randn(3, 4), 4)
    with pytest.raises(ValueError, match="share D"):
        metrics.topk_items(torch.randn(2, 4), torch.randn(3, 5), 1)


def test_hr_ndcg_values():
    ranked = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 3]])
    targets = torch.tensor([5, 7, 9, 2])
    m = metrics.hr_ndcg(ranked, targets)
    assert m["hr"] == pytest.approx(3 / 4)
    assert m["ndcg"] == pytest.approx((1.0 + 0.5 + 0.0 + 1 / math.log2(3)) / 4)


def test_evaluate_and_most_popular():
    N, D, B = 50, 8, 30
    items = torch.nn.functional.normalize(torch.randn(N, D, dtype=torch.float64), dim=1)
    ids = torch.randint(0, 2**40, (N,))
    targets = ids[torch.randint(0, N, (B,))]
    q = items[(ids.unsqueeze(0) == targets.unsqueeze(1)).long().argmax(1)] * 100  # each query its target
    m = metrics.evaluate(q, items, ids, targets, k=1)
    assert m["hr@1"] == 1.0 and m["ndcg@1"] == 1.0
    pop = ids[torch.randperm(N)]
    ref_hits = sum(int(t) in pop[:10].tolist() for t in targets)
    assert metrics.most_popular_metrics(pop, targets, k=10)["hr@10"] == pytest.approx(ref_hits / B)
