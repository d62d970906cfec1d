// The torchfuse._C extension module. It exposes nothing to Python itself: loading it runs the
// TORCH_LIBRARY registrations, and every op is then reached as torch.ops.torchfuse.<name>. Written
// against the limited CPython API so one build serves every Python version (abi3).
#include <Python.h>

static struct PyModuleDef torchfuse_module = {
    PyModuleDef_HEAD_INIT, "_C", "torchfuse native ops (registered with torch.ops.torchfuse)", -1, NULL,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&torchfuse_module); }
