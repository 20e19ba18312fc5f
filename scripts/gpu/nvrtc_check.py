#!/usr/bin/env python3
"""Compile-check the CUDA kernels without a GPU: NVRTC (from the `nvidia-cuda-nvrtc` wheel) compiles
each .cu file to a cubin for sm_90 exactly as the backend does at run time (same include path
layout), then prints NVRTC's log and ptxas' register / spill report per kernel.

Usage: python3 scripts/gpu/nvrtc_check.py [--cuda /opt/cuda-local/nvidia/cu13] [-DNAME[=V] ...] [FILE.cu ...]
(-D defines are passed to NVRTC as the backend does for its variants, e.g. -DGEMV_FP8.)
Default files: worker/engine/src/backend/cuda/kernels/*.cu. Exit 1 on any compile error.
Set-up (once): pip download --no-deps nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-nvcc
nvidia-cuda-cccl and unzip the wheels into one folder (the default path above).
"""
import ctypes, glob, os, subprocess, sys, tempfile

def main():
    args = sys.argv[1:]
    root = "/opt/cuda-local/nvidia/cu13"
    if args[:1] == ["--cuda"]:
        root, args = args[1], args[2:]
    defines = [a.encode() for a in args if a.startswith("-D")]
    args = [a for a in args if not a.startswith("-D")]
    files = args or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "../../worker/engine/src/backend/cuda/kernels/*.cu")))
    lib = ctypes.CDLL(os.path.join(root, "lib/libnvrtc.so.13"))
    ok = True
    for f in files:
        src = open(f, "rb").read()
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(f).encode(), 0, None, None) == 0
        opts = [b"--gpu-architecture=sm_90", b"-I" + os.path.join(root, "include").encode(), b"--std=c++17"] + defines
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        print(f"== {f}: {'OK' if rc == 0 else 'FAILED'}")
        if text:
            print(text)
        if rc != 0:
            ok = False
            continue
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetPTX(prog, ptx)
        with tempfile.NamedTemporaryFile("wb", suffix=".ptx", delete=False) as t:
            t.write(ptx.value)
        r = subprocess.run([os.path.join(root, "bin/ptxas"), "-arch=sm_90", "-v", t.name, "-o", os.devnull], capture_output=True, text=True)
        for line in (r.stdout + r.stderr).splitlines():
            if "Compiling entry" in line or "registers" in line or "spill" in line and not line.strip().startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"):
                print("  " + line.split("info    : ")[-1])
        if r.returncode != 0:
            print(r.stderr)
            ok = False
    sys.exit(0 if ok else 1)

main()
