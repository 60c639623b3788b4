"""Element types and leaf kinds a manifest may name, with each dtype's size in bytes.

Names are torch's and numpy's spellings (docs/FORMAT.md, the leaf table); quantized torch
types are absent: forkpoint does not store them.
"""

DTYPE_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float128": 16, "complex256": 32,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    # torch's sub-byte integer types take one byte an element in memory, and so here
    **{f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)},
}
LEAF_KINDS = frozenset(("torch", "numpy", "numpy_scalar", "bytes", "pickle"))
