// The dynamic embedding ops whose CPU and CUDA implementations differ only in how their kernels run:
// one body each, over a device policy Dev (dynemb.cpp: DynembCpu, dynemb_cuda.cpp: DynembCuda) that
// supplies Guard (makes the table's device current), row_state(table, op) (dynemb_state; on CUDA with
// the host tiers' device addresses) and the kernel runners lookup, insert, touch, init, init_gather,
// evict_rows and update.
#pragma once

#include <torch/library.h>

#include "dynemb.h"

namespace torchfuse {

template <class Dev>
struct DynembOps {
    // The slots of the query keys; epoch > 0 marks the found slots.
    static at::Tensor probe(const at::Tensor &query, const DynembState &st, int64_t epoch, const char *op) {
        check_index(query, st[kKeys], op, "query");
        at::Tensor slots = at::empty({query.numel()}, query.options());
        tf_dynemb_probe p{};
        p.n = query.numel();
        p.query = query.data_ptr<int64_t>();
        p.slots = slots.data_ptr<int64_t>();
        p.epoch = (int32_t)epoch;
        Dev::lookup(st.c.t, p);
        return slots;
    }

    static at::Tensor lookup(const at::Tensor &query, at::TensorList table, int64_t epoch) {
        const char *op = "torchfuse.dynemb_lookup";
        const DynembState st = dynemb_state(table, op);
        const typename Dev::Guard guard(st[kKeys].device());
        return probe(query, st, epoch, op);
    }

    static DynembInsertResult insert(const at::Tensor &query, at::Tensor &slots, at::TensorList table, int64_t epoch,
                                     bool allow_evict) {
        const DynembState st = dynemb_state(table, "torchfuse.dynemb_insert");
        const typename Dev::Guard guard(st[kKeys].device());
        DynembInsert ins = prepare_dynemb_insert(query, slots, st, epoch, allow_evict);
        Dev::insert(ins.t, ins.p);
        return ins.result();
    }

    static void touch(at::TensorList table, const at::Tensor &slots, int64_t policy, int64_t clock) {
        const char *op = "torchfuse.dynemb_touch";
        const DynembState st = dynemb_state(table, op);
        const typename Dev::Guard guard(st[kKeys].device());
        check_index(slots, st[kKeys], op, "slots");
        Dev::touch(st.c.t.scores, slots.data_ptr<int64_t>(), slots.numel(), (int)policy, clock);
    }

    static void init(const at::Tensor &slots, const at::Tensor &keys, const std::optional<at::Tensor> &mask,
                     at::TensorList table, int64_t init_kind, double a, double b, int64_t seed) {
        const char *op = "torchfuse.dynemb_init";
        const DynembState st = Dev::row_state(table, op);
        const typename Dev::Guard guard(st[kKeys].device());
        Dev::init(dynemb_init_params(slots, keys, mask, st, init_kind, a, b, seed, op));
    }

    static at::Tensor init_gather(const at::Tensor &slots, const at::Tensor &keys, const at::Tensor &is_new,
                                  at::TensorList table, int64_t init_kind, double a, double b, int64_t seed,
                                  const std::optional<at::Tensor> &order) {
        const DynembState st = Dev::row_state(table, "torchfuse.dynemb_init_gather");
        const typename Dev::Guard guard(st[kKeys].device());
        const int64_t *ord = nullptr;
        at::Tensor out;
        const tf_dynemb_init_params p =
            dynemb_init_gather_params(slots, keys, is_new, st, init_kind, a, b, seed, order, &ord, out);
        Dev::init_gather(p, ord, out.data_ptr());
        return out;
    }

    // find-or-insert's eviction row work (st: from row_state): (the victims' values, their state).
    static std::tuple<at::Tensor, at::Tensor> evict_rows(const at::Tensor &slots, const at::Tensor &new_index,
                                                         const at::Tensor &keys, const DynembState &st,
                                                         at::Tensor &rows, int64_t init_kind, double a, double b,
                                                         int64_t seed) {
        at::Tensor old_values, old_state;
        Dev::evict_rows(
            dynemb_evict_params(slots, new_index, keys, st, rows, init_kind, a, b, seed, old_values, old_state));
        return {old_values, old_state};
    }

    // st: from row_state
    static void update_state(const at::Tensor &slots, const at::Tensor &grad, const DynembState &st, int64_t opt,
                             double lr, double eps, double beta1, double beta2, double step_size) {
        Dev::update(dynemb_update_params(slots, &grad, st, opt, lr, eps, beta1, beta2, step_size));
    }

    static void update(const at::Tensor &slots, const at::Tensor &grad, at::TensorList table, int64_t opt, double lr,
                       double eps, double beta1, double beta2, double step_size) {
        const DynembState st = Dev::row_state(table, "torchfuse.dynemb_update");
        const typename Dev::Guard guard(st[kKeys].device());
        update_state(slots, grad, st, opt, lr, eps, beta1, beta2, step_size);
    }

    static void register_impls(torch::Library &m) {
        m.impl("dynemb_lookup", &lookup);
        m.impl("dynemb_insert", &insert);
        m.impl("dynemb_touch", &touch);
        m.impl("dynemb_init", &init);
        m.impl("dynemb_init_gather", &init_gather);
        m.impl("dynemb_update", &update);
    }
};

}  // namespace torchfuse
