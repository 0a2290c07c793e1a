/*
 * The embedding half of the simulated libnvidia-ml.so.1: every generated trampoline (gen.py)
 * calls gpud_nvmlc_call, which runs the function in an embedded CPython through
 * gpud.sim.nvmlc.bridge, the same simulator (gpud/sim/nvml_lib.py FakeNvmlLib) that gpud's tests
 * load into pynvml.
 *
 * Invariants:
 * - Nothing happens at load time: a program that only dlopens and dlcloses the library (go-nvml's
 *   probes do) starts no interpreter. The first call starts it, once per process (pthread_once).
 * - The interpreter is isolated: no environment variables of Python's own, no site import, no
 *   signal handlers (the host program keeps its own, Go's runtime included), no bytecode written.
 *   Its home and module path come from GPUD_SIM_PYTHONHOME and GPUD_SIM_PYTHONPATH, which
 *   `gpud-sim exec` sets; the simulated host from GPUD_SIM_DIR.
 * - Any thread may call: each call takes the GIL with PyGILState_Ensure and gives it back, so Go's
 *   threads (or a C program's) never need to be known to Python beforehand.
 * - libpython's symbols are promoted to the global scope before the first import, so extension
 *   modules (_ctypes, msgspec) resolve them even when the host dlopened this library RTLD_LOCAL.
 * - When the interpreter cannot start or the bridge fails, every call answers
 *   NVML_ERROR_UNKNOWN and the reason is printed once on stderr: never a crash.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpud_nvmlc.h"

#define NVML_ERROR_UNKNOWN 999

static pthread_once_t started = PTHREAD_ONCE_INIT;
static PyObject *bridge_call;   /* gpud.sim.nvmlc.bridge.call(index, args) -> int */
static PyObject *bridge_string; /* gpud.sim.nvmlc.bridge.error_string(code) -> bytes */

static void fail(const char *what) {
    fprintf(stderr, "libnvidia-ml.so.1 (gpud-sim): %s; every NVML call answers NVML_ERROR_UNKNOWN\n", what);
}

static int append_paths(PyConfig *config, const char *paths) {
    char *copy = strdup(paths), *save = NULL;
    if (copy == NULL)
        return -1;
    for (char *p = strtok_r(copy, ":", &save); p != NULL; p = strtok_r(NULL, ":", &save)) {
        wchar_t *w = Py_DecodeLocale(p, NULL);
        if (w == NULL || PyStatus_Exception(PyWideStringList_Append(&config->module_search_paths, w))) {
            PyMem_RawFree(w);
            free(copy);
            return -1;
        }
        PyMem_RawFree(w);
    }
    free(copy);
    config->module_search_paths_set = 1;
    return 0;
}

/* With the GIL held: import the bridge, hand it the generated tables, keep its two entry points. */
static void load_bridge(void) {
    PyObject *mod = PyImport_ImportModule("gpud.sim.nvmlc.bridge");
    PyObject *sigs = NULL, *sizes = NULL, *ok = NULL;
    if (mod == NULL)
        goto error;
    sigs = PyList_New(gpud_nvmlc_nfunctions);
    sizes = PyDict_New();
    if (sigs == NULL || sizes == NULL)
        goto error;
    for (unsigned i = 0; i < gpud_nvmlc_nfunctions; i++)
        PyList_SET_ITEM(sigs, i, PyUnicode_FromString(gpud_nvmlc_signatures[i]));
    for (unsigned i = 0; i < gpud_nvmlc_nsizes; i++) {
        PyObject *v = PyLong_FromUnsignedLong(gpud_nvmlc_sizes[i].size);
        if (v == NULL || PyDict_SetItemString(sizes, gpud_nvmlc_sizes[i].type, v) < 0)
            goto error;
        Py_DECREF(v);
    }
    ok = PyObject_CallMethod(mod, "setup", "OO", sigs, sizes);
    if (ok == NULL)
        goto error;
    bridge_call = PyObject_GetAttrString(mod, "call");
    bridge_string = PyObject_GetAttrString(mod, "error_string");
    if (bridge_call == NULL || bridge_string == NULL)
        goto error;
    Py_DECREF(ok);
    Py_DECREF(sigs);
    Py_DECREF(sizes);
    Py_DECREF(mod);
    return;
error:
    PyErr_Print();
    fail("the simulator's bridge (gpud.sim.nvmlc.bridge) did not load");
    Py_CLEAR(bridge_call);
    Py_CLEAR(bridge_string);
    Py_XDECREF(ok);
    Py_XDECREF(sigs);
    Py_XDECREF(sizes);
    Py_XDECREF(mod);
}

static void start(void) {
    Dl_info info;
    if (dladdr((void *)&Py_IsInitialized, &info) && info.dli_fname != NULL)
        dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (Py_IsInitialized()) { /* loaded into a Python process: use its interpreter */
        PyGILState_STATE g = PyGILState_Ensure();
        load_bridge();
        PyGILState_Release(g);
        return;
    }
    const char *home = getenv("GPUD_SIM_PYTHONHOME"), *path = getenv("GPUD_SIM_PYTHONPATH");
    if (getenv("GPUD_SIM_DIR") == NULL || path == NULL) {
        fail("GPUD_SIM_DIR or GPUD_SIM_PYTHONPATH is not set (run the program with `gpud-sim exec DIR -- ...`)");
        return;
    }
    PyConfig config;
    PyConfig_InitIsolatedConfig(&config);
    config.install_signal_handlers = 0;
    config.site_import = 0;
    config.write_bytecode = 0;
    config.pathconfig_warnings = 0;
    config.parse_argv = 0;
    PyStatus status = PyStatus_Ok();
    if (home != NULL && *home)
        status = PyConfig_SetBytesString(&config, &config.home, home);
    if (PyStatus_Exception(status) || append_paths(&config, path) < 0) {
        PyConfig_Clear(&config);
        fail("bad GPUD_SIM_PYTHONHOME or GPUD_SIM_PYTHONPATH");
        return;
    }
    status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status)) {
        fprintf(stderr, "libnvidia-ml.so.1 (gpud-sim): Python: %s\n", status.err_msg ? status.err_msg : "?");
        fail("the embedded Python did not start");
        return;
    }
    load_bridge();
    PyEval_SaveThread(); /* from now on every caller takes the GIL itself */
}

int gpud_nvmlc_call(unsigned index, const uint64_t *args, unsigned nargs) {
    pthread_once(&started, start);
    if (bridge_call == NULL)
        return NVML_ERROR_UNKNOWN;
    PyGILState_STATE g = PyGILState_Ensure();
    long rc = NVML_ERROR_UNKNOWN;
    PyObject *tuple = PyTuple_New(nargs), *res = NULL;
    if (tuple == NULL)
        goto out;
    for (unsigned i = 0; i < nargs; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(args[i]);
        if (v == NULL)
            goto out;
        PyTuple_SET_ITEM(tuple, i, v);
    }
    res = PyObject_CallFunction(bridge_call, "IO", index, tuple);
    if (res != NULL) {
        rc = PyLong_AsLong(res);
        if (rc == -1 && PyErr_Occurred())
            rc = NVML_ERROR_UNKNOWN;
    }
out:
    if (PyErr_Occurred())
        PyErr_Print();
    Py_XDECREF(res);
    Py_XDECREF(tuple);
    PyGILState_Release(g);
    return (int)rc;
}

/* Error strings are fetched from the simulator once per code and kept for the process's life. */
#define CACHED_CODES 1024
static const char *strings[CACHED_CODES];
static pthread_mutex_t strings_lock = PTHREAD_MUTEX_INITIALIZER;

const char *gpud_nvmlc_error_string(int result) {
    static const char unknown[] = "Unknown Error";
    int slot = result >= 0 && result < CACHED_CODES ? result : NVML_ERROR_UNKNOWN;
    pthread_mutex_lock(&strings_lock);
    const char *s = strings[slot];
    pthread_mutex_unlock(&strings_lock);
    if (s != NULL)
        return s;
    pthread_once(&started, start);
    if (bridge_string == NULL)
        return unknown;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *res = PyObject_CallFunction(bridge_string, "i", slot);
    char *copy = NULL;
    if (res != NULL && PyBytes_Check(res))
        copy = strdup(PyBytes_AS_STRING(res));
    if (PyErr_Occurred())
        PyErr_Print();
    Py_XDECREF(res);
    PyGILState_Release(g);
    if (copy == NULL)
        return unknown;
    pthread_mutex_lock(&strings_lock);
    if (strings[slot] == NULL)
        strings[slot] = copy;
    else
        free(copy);
    s = strings[slot];
    pthread_mutex_unlock(&strings_lock);
    return s;
}
