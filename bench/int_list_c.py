"""Could a C extension write the ids' JSON faster than orjson? (issue 32 item 4: "what no Python-only packing can avoid")

The sender's largest single cost is ``orjson.dumps`` of each span's id lists (~42 % of its
instructions). This compiles a small CPython extension (the system C compiler, ``-O3``, into a
temporary directory; nothing is installed) whose one function writes a list of ints as JSON the
plain way: ``PyLong_AsLongLongAndOverflow`` for each item and two digits at a time from a table
(``C``), and again reading a small int's value straight from the object as orjson does
(``C digits``: CPython's own layout, 3.10–3.13).
It checks that its bytes equal orjson's, then times both on 2,000-id lists, alternating (ABAB).
Without a compiler or Python's headers it says so and exits 0.

    .venv/bin/python bench/int_list_c.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import orjson

from common import alternating_cpu, print_against

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h>
#elif PY_VERSION_HEX < 0x030C0000
#include <cpython/longintrepr.h>
#endif

static const char PAIRS[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

static char *write_u64(char *out, unsigned long long v) {
    char buf[24];
    char *p = buf + sizeof buf;
    while (v >= 100) { unsigned r = (unsigned)(v % 100); v /= 100; p -= 2; memcpy(p, PAIRS + 2 * r, 2); }
    if (v >= 10) { p -= 2; memcpy(p, PAIRS + 2 * v, 2); } else { *--p = (char)('0' + v); }
    size_t n = (size_t)(buf + sizeof buf - p);
    memcpy(out, p, n);
    return out + n;
}

/* a small int's value read straight from the object (CPython's own layout), as orjson reads it */
static long long direct_value(PyObject *item, int *overflow) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) return (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
#else
    if (Py_SIZE(item) == 1) return (long long)((PyLongObject *)item)->ob_digit[0];
    if (Py_SIZE(item) == 0) return 0;
#endif
    return PyLong_AsLongLongAndOverflow(item, overflow);
}

/* a list of ints as JSON, or None for anything else (so the caller falls back to orjson) */
static PyObject *dump(PyObject *arg, int direct) {
    if (!PyList_CheckExact(arg)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *res = PyBytes_FromStringAndSize(NULL, n * 22 + 2);
    if (res == NULL) return NULL;
    char *start = PyBytes_AS_STRING(res), *out = start;
    *out++ = '[';
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(arg, i);
        int overflow = 0;
        long long v;
        if (!PyLong_CheckExact(item)) { Py_DECREF(res); Py_RETURN_NONE; }
        v = direct ? direct_value(item, &overflow) : PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) { Py_DECREF(res); Py_RETURN_NONE; }
        if (i) *out++ = ',';
        if (v < 0) { *out++ = '-'; out = write_u64(out, 0ULL - (unsigned long long)v); }
        else out = write_u64(out, (unsigned long long)v);
    }
    *out++ = ']';
    if (_PyBytes_Resize(&res, out - start) < 0) return NULL;
    return res;
}

static PyObject *dump_ints(PyObject *self, PyObject *arg) { return dump(arg, 0); }
static PyObject *dump_ints_digits(PyObject *self, PyObject *arg) { return dump(arg, 1); }

static PyMethodDef methods[] = {{"dump_ints", dump_ints, METH_O, NULL}, {"dump_ints_digits", dump_ints_digits, METH_O, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "int_list_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_int_list_probe(void) { return PyModule_Create(&module); }
"""


def build(tmp: Path) -> object | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    if compiler is None or not (Path(include) / "Python.h").exists():
        return None
    source, target = tmp / "int_list_probe.c", tmp / f"int_list_probe{sysconfig.get_config_var('EXT_SUFFIX')}"
    source.write_text(SOURCE)
    built = subprocess.run([compiler, "-O3", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(target)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        print(f"the probe does not compile here:\n{built.stderr[-2000:]}")
        return None
    spec = importlib.util.spec_from_file_location("int_list_probe", target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--lists", type=int, default=2000, help="2,000-id lists written per path and round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="int-list-c-") as tmp:
        probe = build(Path(tmp))
        if probe is None:
            print("no C compiler, no Python.h, or no build here: nothing measured")
            return
        rng = random.Random(1)
        lists = [[rng.randrange(150_000) for _ in range(2000)] for _ in range(8)]
        for ids in lists + [[], [0], [-1, 2**63 - 1, -(2**63)]]:
            if probe.dump_ints(ids) != orjson.dumps(ids) or probe.dump_ints_digits(ids) != orjson.dumps(ids):  # type: ignore[attr-defined]
                raise SystemExit(f"the probe's bytes differ from orjson's for {ids[:3]}…")
        dumps = {"orjson": orjson.dumps, "C": probe.dump_ints, "C digits": probe.dump_ints_digits}  # type: ignore[attr-defined]

        def writing(dump: Any) -> Any:
            return lambda: [dump(lists[i & 7]) for i in range(args.lists)]

        cpu = alternating_cpu({name: writing(dump) for name, dump in dumps.items()}, args.rounds, args.lists)
    print(f"{args.rounds} rounds (ABBA), {args.lists} lists of 2,000 ids a path and round; µs a list, and against orjson")
    print_against(cpu, "orjson")

if __name__ == "__main__":
    main()
