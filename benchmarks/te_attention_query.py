"""Which head dims Transformer Engine's compiled cuDNN query gives a training kernel, measured on a CPU.

Transformer Engine decides whether cuDNN fused attention can run in C++ (``nvte_get_fused_attn_backend``), whose
source is not on PyPI. Its wheels are: this script loads ``libtransformer_engine.so`` of a transformer_engine_cu12
wheel with stub CUDA runtime / cuDNN / cuBLAS / NCCL libraries built here (the GPU's compute capability and cuDNN's
version come from environment variables), calls the query for a causal bf16 sbhd self-attention in training, and
prints the sub-backend it returns (1 = F16_arbitrary_seqlen, -1 = No_Backend) per compute capability, cuDNN version
and (q/k, v) head dims; for TE 2.20 it prints the reject message too (``nvte_get_fused_attn_backend_v2`` builds the
cuDNN-frontend graphs, whose checks make the message; the stub cuDNN accepts whatever graph passes them).
estimator/attention_backend.py and tests/test_properties_attention_backend.py rest on its output
(benchmarks/results/te-attention-query.md).

    pip download --no-deps --only-binary=:all: transformer_engine_cu12==2.20.2 -d /tmp/te
    (cd /tmp/te && unzip -q *.whl)
    python benchmarks/te_attention_query.py --lib /tmp/te/transformer_engine/wheel_lib/libtransformer_engine.so \
        --api v2 --sm 80 90 100 --cudnn 91801 92300 --dims 128/128 160/160 256/256 192/128

``--api v1`` for TE 2.11 (its 18-argument query), ``v2`` for TE 2.20. Needs gcc; Linux x86-64 only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

_CUDART = r"""
#include <stdlib.h>
#include <string.h>
static int cc(void){ const char*s=getenv("STUB_SM"); return s?atoi(s):100; }
static char fake[64];
int cudaGetDevice(int*d){*d=0;return 0;}
int cudaGetDeviceCount(int*c){*c=1;return 0;}
int cudaSetDevice(int d){return 0;}
int cudaDeviceGetAttribute(int*v,int a,int d){*v = a==75 ? cc()/10 : a==76 ? cc()%10 : a==16 ? 132 : 0; return 0;}
int cudaRuntimeGetVersion(int*v){*v=12090;return 0;}
int cudaDriverGetVersion(int*v){*v=12090;return 0;}
const char* cudaGetErrorString(int e){return "stub";}
int cudaGetLastError(void){return 0;}
int cudaPeekAtLastError(void){return 0;}
/* cudaDeviceProp (CUDA 12): major at byte 360, minor at 364 */
int cudaGetDeviceProperties_v2(void*p,int d){
  memset(p,0,1032);*(int*)((char*)p+360)=cc()/10;*(int*)((char*)p+364)=cc()%10;return 0;}
int cudaGetDeviceProperties(void*p,int d){return cudaGetDeviceProperties_v2(p,d);}
int cudaDeviceGetStreamPriorityRange(int*a,int*b){*a=0;*b=-1;return 0;}
void** __cudaRegisterFatBinary(void*f){return (void**)fake;}
void __cudaRegisterFatBinaryEnd(void**h){}
void __cudaUnregisterFatBinary(void**h){}
void __cudaRegisterFunction(void**h,const char*a,char*b,const char*c,int d,void*e,void*f,void*g,void*i,int*j){}
void __cudaRegisterVar(void**h,char*a,char*b,const char*c,int d,size_t e,int f,int g){}
void __cudaRegisterManagedVar(void**h,void**a,char*b,const char*c,int d,size_t e,int f,int g){}
int __cudaPushCallConfiguration(void){return 0;}
int __cudaPopCallConfiguration(void){return 0;}
static int ok(void){return 0;}
static int drv_attr(int*v,int a,int d){*v = a==75 ? cc()/10 : a==76 ? cc()%10 : 0; return 0;}
static int drv_dev(int*d){*d=0;return 0;}
static int drv_ctx(void**c){*c=(void*)fake;return 0;}
static void* pick(const char*s){
  if(!strcmp(s,"cuCtxGetCurrent")) return (void*)drv_ctx;
  if(!strcmp(s,"cuDeviceGetAttribute")) return (void*)drv_attr;
  if(!strcmp(s,"cuCtxGetDevice")) return (void*)drv_dev;
  return (void*)ok; }
int cudaGetDriverEntryPoint(const char*s,void**f,unsigned long long fl,int*st){*f=pick(s);if(st)*st=0;return 0;}
int cudaGetDriverEntryPointByVersion(const char*s,void**f,unsigned int v,unsigned long long fl,int*st){
  *f=pick(s);if(st)*st=0;return 0;}
"""

_CUDNN = r"""
#include <stdlib.h>
static char handle[256];
static long ndesc;
size_t cudnnGetVersion(void){ const char*s=getenv("STUB_CUDNN"); return s?strtoul(s,0,10):91801; }
size_t cudnnGetCudartVersion(void){ return 12090; }
const char* cudnnGetErrorString(int e){return "stub";}
void cudnnGetLastErrorString(char*m,size_t n){ if(n) m[0]=0; }
int cudnnCreate(void**h){*h=handle;return 0;}
int cudnnSetStream(void*h,void*s){return 0;}
int cudnnGetStream(void*h,void**s){*s=0;return 0;}
int cudnnBackendCreateDescriptor(int t,void**d){*d=(void*)(0x1000+(++ndesc));return 0;}
int cudnnBackendDestroyDescriptor(void*d){return 0;}
int cudnnBackendFinalize(void*d){return 0;}
int cudnnBackendSetAttribute(void*d,int a,int t,long n,const void*v){return 0;}
/* one engine config from the heuristics (CUDNN_ATTR_ENGINEHEUR_RESULTS = 202), zero workspace / shared memory */
int cudnnBackendGetAttribute(void*d,int a,int t,long req,long*cnt,void*v){
  if(cnt)*cnt = a==202 ? 1 : 0;
  if(v && req>0 && (t==3 || t==23)){ if(t==3) *(long*)v=0; else *(int*)v=0; if(cnt)*cnt=1; }
  return 0;}
int cudnnBackendExecute(void*h,void*p,void*v){return 0;}
"""

_PLAIN = r"""
int ncclCommCount(void*c,int*n){*n=1;return 0;}
const char* ncclGetErrorString(int r){return "stub";}
int ncclGetVersion(int*v){*v=22700;return 0;}
"""
_NVRTC = ("nvrtcAddNameExpression nvrtcCompileProgram nvrtcCreateProgram nvrtcDestroyProgram nvrtcGetCUBIN "
          "nvrtcGetCUBINSize nvrtcGetErrorString nvrtcGetLoweredName nvrtcGetNumSupportedArchs nvrtcGetPTX "
          "nvrtcGetPTXSize nvrtcGetProgramLog nvrtcGetProgramLogSize nvrtcGetSupportedArchs nvrtcVersion").split()

_EMPTY_LIBS = ["libcudnn_graph.so.9", "libcudnn_engines_runtime_compiled.so.9", "libcudnn_ops.so.9",
               "libcudnn_cnn.so.9", "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_heuristic.so.9"]

# the query, run in a child process with the stubs on LD_LIBRARY_PATH (enum values: TE's fused_attn.h and
# transformer_engine.h: kNVTEBFloat16 = 6, NVTE_SBHD_SBHD_SBHD = 4, NVTE_SBHD = 0, NVTE_CAUSAL_MASK = 2)
_CHILD = r"""
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_LAZY | ctypes.RTLD_GLOBAL)
api, dropout, det, heads, groups, seq = sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1", *map(int, sys.argv[5:8])
for spec in sys.argv[8:]:
    qk, v = map(int, spec.split("/"))
    msg = ""
    if api == "v1":
        f = lib.nvte_get_fused_attn_backend
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_bool] + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_size_t] * 6 + \
            [ctypes.c_int64] * 2 + [ctypes.c_bool] * 2
        r = f(True, 6, 6, 4, 0, 2, 0, dropout, heads, groups, seq, seq, qk, v, -1, 0, False, False)
    else:
        lib.nvte_create_fused_attn_config.restype = ctypes.c_void_p
        lib.nvte_set_fused_attn_config_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                             ctypes.c_size_t]
        lib.nvte_get_fused_attn_backend_v2.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvte_get_fused_attn_backend_v2.restype = ctypes.c_int
        cfg = lib.nvte_create_fused_attn_config()
        def put(attr, ctype, val):
            x = ctype(val)
            lib.nvte_set_fused_attn_config_attribute(cfg, attr, ctypes.byref(x), ctypes.sizeof(x))
        # NVTEFusedAttnConfigAttribute order (TE 2.20.2 fused_attn.h)
        put(0, ctypes.c_uint8, 1); put(1, ctypes.c_uint8, det); put(4, ctypes.c_int, 2); put(5, ctypes.c_int, 0)
        put(6, ctypes.c_int64, -1); put(7, ctypes.c_int64, 0); put(9, ctypes.c_int, 0); put(10, ctypes.c_int, 0)
        put(11, ctypes.c_float, dropout); put(12, ctypes.c_float, qk ** -0.5)
        for a in (13, 14, 15, 16):
            put(a, ctypes.c_int, 6)
        put(17, ctypes.c_int, 4); put(20, ctypes.c_int, 4)
        for a in (18, 19, 21, 22):
            put(a, ctypes.c_int, 0)
        for a, n in ((23, 1), (24, heads), (25, groups), (26, qk), (27, v), (28, seq), (29, seq), (30, seq), (31, seq)):
            put(a, ctypes.c_size_t, n)
        m = ctypes.c_char_p()
        r = lib.nvte_get_fused_attn_backend_v2(cfg, ctypes.byref(m))
        msg = (m.value or b"").decode(errors="replace").split("\n")[0][:160]
    print(spec, r, msg, flush=True)
"""


def build_stubs(d: str) -> None:
    """Compile the stub libraries into ``d`` (each with the version node the library links against)."""
    def so(name: str, src: str, version: str | None = None) -> None:
        c = os.path.join(d, name + ".c")
        with open(c, "w") as f:
            f.write(src)
        cmd = ["gcc", "-shared", "-fPIC", "-o", os.path.join(d, name), c, f"-Wl,-soname,{name}"]
        if version:
            m = os.path.join(d, name + ".map")
            with open(m, "w") as f:
                f.write(f"{version} {{ global: *; }};\n")
            cmd.append(f"-Wl,--version-script={m}")
        subprocess.run(cmd, check=True)
    so("libcudart.so.12", _CUDART, "libcudart.so.12")
    so("libcudnn.so.9", _CUDNN, "libcudnn.so.9")
    so("libcudnn_graph.so.9", _CUDNN)
    so("libcublas.so.12", "void __stub(void){}\n", "libcublas.so.12")
    so("libcublasLt.so.12", "void __stub(void){}\n", "libcublasLt.so.12")
    for name in _EMPTY_LIBS:
        so(name, "void __stub(void){}\n")
    so("libnccl.so.2", _PLAIN + "".join(f"int {s}(void){{return 0;}}\n" for s in _NVRTC))


def query(lib: str, stubs: str, api: str, sm: int, cudnn: int, dims: list[str], dropout: float = 0.0,
          deterministic: bool = False, heads: int = 32, groups: int = 8, seq: int = 4096) -> list[tuple[str, int, str]]:
    env = dict(os.environ, STUB_SM=str(sm), STUB_CUDNN=str(cudnn), LD_LIBRARY_PATH=stubs,
               LD_PRELOAD=os.path.join(stubs, "libnccl.so.2"), CUDNN_FRONTEND_CUDART_LIB_NAME="libcudart.so.12")
    out = subprocess.run([sys.executable, "-c", _CHILD, lib, api, str(dropout), "1" if deterministic else "0",
                          str(heads), str(groups), str(seq), *dims], env=env, capture_output=True, text=True,
                         timeout=300)
    rows = []
    for line in out.stdout.splitlines():
        spec, r, *msg = line.split(" ", 2)
        rows.append((spec, int(r), msg[0] if msg else ""))
    if not rows:
        rows.append(("-", 0, (out.stderr.strip().splitlines() or ["no output"])[-1][:160]))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", required=True, help="libtransformer_engine.so of a transformer_engine_cu12 wheel")
    p.add_argument("--api", choices=("v1", "v2"), required=True, help="v1: TE 2.11's query; v2: TE 2.20's")
    p.add_argument("--sm", type=int, nargs="+", default=[80, 90, 100])
    p.add_argument("--cudnn", type=int, nargs="+", default=[91801])
    p.add_argument("--dims", nargs="+", default=["64/64", "128/128", "160/160", "256/256", "264/264", "192/128"])
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        build_stubs(d)
        for sm in args.sm:
            for cu in args.cudnn:
                for spec, r, msg in query(args.lib, d, args.api, sm, cu, args.dims, args.dropout,
                                          args.deterministic):
                    print(f"sm{sm} cudnn {cu} {spec}: {r}" + (f"  ({msg})" if msg else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
