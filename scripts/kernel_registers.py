"""What ptxas makes of a kernel for an H200 (sm_90), on a machine without a GPU: registers a
thread, spilled stack bytes, shared memory, for the settings given. It proves the kernel compiles
for the GPU and shows its register pressure (a spill, or 255 registers, costs time), nothing about
its speed.

    PYTHONPATH=. python scripts/kernel_registers.py [--kernel rerank] [--kernel tree_accept] [--standing] [--json]

Each kernel below is compiled at the shapes a 6-10-60-4 tree step launches it with (210
candidates, 60 nodes, a 49,152-token vocabulary in 24 argmax chunks), for each setting listed,
the runtime's own first.
Triton's own ptxas and cuobjdump do it (the triton wheel carries them); TRITON_INTERPRET must be
unset.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
import triton.backends.nvidia as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

I64, U8, F32, BF16 = "*i64", "*u8", "*fp32", "*bf16"


def _kernels():
    """name → (kernel, pointer types by argument, [(label, constexprs, warps)])."""
    import draftsmith_kernels.tree_select as select
    from draftsmith_kernels.tree_accept import _tree_accept_kernel
    from draftsmith_kernels.tree_select import _frontier_norm_pair_kernel, _rerank_kernel

    rerank_types = dict(scores_ptr=F32, tokens_ptr=I64, parents_ptr=I64, anc_ptr=U8, base_ptr=I64, o_tokens_ptr=I64,
                        o_parents_ptr=I64, o_depths_ptr=I64, o_mask_ptr=U8, o_positions_ptr=I64, loop_tokens_ptr=I64,
                        loop_length_ptr=I64, fed_ptr=I64, fed_positions_ptr=I64, k_ptr=BF16, v_ptr=BF16, src_ptr=I64,
                        dst_ptr=I64)
    accept_types = dict(tokens_ptr=I64, parents_ptr=I64, mask_ptr=U8, choice_ptr=F32, base_ptr=I64, root_ptr=I64,
                        active_ptr=U8, path_ptr=I64, length_ptr=I64, bonus_ptr=I64, path_tokens_ptr=I64, fed_ptr=I64,
                        index_ptr=I64, src_ptr=I64, dst_ptr=I64, cidx_ptr=I64, eos_ptr=I64, budget_ptr=I64,
                        out_tokens_ptr=I64, state_length_ptr=I64, n_out_ptr=I64, done_ptr="*i1", histogram_ptr=I64,
                        row_steps_ptr=I64, active_out_ptr="*i1", last_ptr=I64, next_ptr=I64, next_pos_ptr=I64)
    frontier_types = dict(tokens_ptr=I64, scores_ptr=F32, anc_ptr=U8, last_ptr=I64, o_index_ptr=I64, o_scores_ptr=F32,
                          o_tokens_ptr=I64, o_parent_row_ptr=I64, o_visible_ptr=U8, o_positions_ptr=I64, table_ptr=BF16,
                          tw_ptr=BF16, x_ptr=BF16, xw_ptr=BF16, out_ptr=BF16, xo_ptr=BF16, eps="fp32")

    # the first setting of each: the runtime's own (TreeSelectTuning's defaults), then alternatives
    t = select.TreeSelectTuning()

    def standing(c):  # the rerank's tiles at c candidates (a power of two), as finalize_triton picks them
        return (c, max(1, min(t.rerank_rows, t.rerank_tile // c)), max(1, min(t.rerank_columns, t.rerank_tile // c)),
                t.rerank_warps)

    rerank = [(f"{c} candidates, {i} rows / {j} columns a tile, {w} warps",
               dict(BLOCK_C=c, BLOCK_I=i, BLOCK_J=j, FEED=True, HEAD_DIM=64, BLOCK_H=4, BLOCK_M=8,
                    BLOCK_D=64), w)
              for c, i, j, w in (standing(256), (256, 16, 16, 4), (256, 16, 32, 4), (256, 32, 32, 8), standing(512),
                                 standing(1024), standing(2048))]
    # 60 nodes: 64 lanes for the nodes and for their 61 outputs; 64 nodes: 128 for the 65 outputs
    accept = [(f"{n} nodes, {w} warps", dict(BLOCK_N=64, BLOCK_O=64 if n < 64 else 128, BLOCK_D=8, FROM_CHUNKS=True,
                                             BLOCK_S=32, EMIT=True, HAS_ACTIVE_OUT=True, NEXT=True), w)
              for n, w in ((60, 4), (60, 8), (64, 4))]
    warps = t.frontier_warps
    frontier = [(f"{warps} warps", dict(BLOCK_M=64, BLOCK_C=256, BLOCK=1024), warps)]
    return {"rerank": (_rerank_kernel, rerank_types, rerank),
            "tree_accept": (_tree_accept_kernel, accept_types, accept),
            "frontier": (_frontier_norm_pair_kernel, frontier_types, frontier)}


def resources(kernel, types: dict, constexprs: dict, warps: int) -> dict:
    """Compile for sm_90 → {"registers", "stack", "shared"} (integers: pointer and float
    arguments as `types` names them, every other argument i32)."""
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = {key: re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK")}
    if not all(found.values()):
        raise RuntimeError(f"cuobjdump gave no register count:\n{usage}")
    return {"registers": int(found["REG"].group(1)), "stack": int(found["STACK"].group(1)),
            "shared": compiled.metadata.shared}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", action="append", choices=sorted(_kernels()), help="(default: all)")
    ap.add_argument("--standing", action="store_true", help="the runtime's own settings only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_registers: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    table = _kernels()
    rows = []
    for name in args.kernel or sorted(table):
        kernel, types, settings = table[name]
        for label, constexprs, warps in settings[:1] if args.standing else settings:
            rows.append({"kernel": name, "setting": label, **resources(kernel, types, constexprs, warps)})
            if not args.json:
                r = rows[-1]
                print(f"{name:12s} {label:48s} {r['registers']:4d} registers, {r['stack']:4d} B stack, "
                      f"{r['shared']:6d} B shared")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
