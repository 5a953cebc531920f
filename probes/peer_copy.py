"""An all-to-all of fixed slots on the copy engines (peer copies into symmetric memory) against NCCL's,
alone and beside a GEMM or an MoE step, one process per GPU.

    python probes/peer_copy.py [--world W] [--rows 16384] [--dim 2048] [--reps 10] [--split 1 2 4] [--pull]
                               [--moe-tokens T [--hidden 768 --experts 32 --top-k 8]]

Expert parallelism's device splits send one fixed slot of ``rows`` token rows to every rank, so the
host knows the size of every copy. Here each rank fills a (W, rows, dim) bf16 send buffer and every
rank receives slot j of rank i into slot i of its own symmetric receive buffer, two ways:

- **nccl**: ``all_to_all_single`` with equal splits (what ``ExpertParallelMoE`` runs);
- **peer copies**: ``copy_`` calls into the peers' receive buffers (mapped by
  ``torch.distributed._symmetric_memory``), each slot split into ``--split`` row blocks, one side
  stream per block, then the buffer's barrier so that every rank's slots have landed before anyone
  reads them. With ``--pull`` each rank instead reads its slots out of the peers' send buffers
  (symmetric too), after a barrier that says they are written.

Per way: the exchange alone, a bf16 matmul alone (M x K x N = 8192 x 8192 x 8192 by default) and both
at once (the exchange on a side stream); and whether the received slots equal NCCL's. If the copies
run on the copy engines, the matmul beside them keeps its speed, which NCCL's kernels (SMs of their
own) do not let it do. With ``--moe-tokens T`` the work beside the exchange is instead one forward and
backward of a ``moekit.MoE`` block of T tokens (plain SwiGLU, no biases; ``--experts`` is the experts
one rank holds, so the defaults are qwen3-30b-a3b's share at EP 4): what an expert-parallel step with
chunks runs beside each chunk's exchanges. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.multiprocessing as mp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _ms(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / reps], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
    return t.item()


def _worker(rank, world, folder, a):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    group = dist.group.WORLD
    rows, dim = a.rows, a.dim
    gen = torch.Generator(device="cuda").manual_seed(rank)
    send = torch.randn(world, rows, dim, device="cuda", generator=gen).to(torch.bfloat16)
    recv_nccl = torch.empty_like(send)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    recv = symm_mem.empty((world, rows, dim), dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(recv, group.group_name)
    peers = [handle.get_buffer(p, (world, rows, dim), torch.bfloat16) for p in range(world)]
    sym_send = symm_mem.empty((world, rows, dim), dtype=torch.bfloat16, device="cuda")
    sym_send.copy_(send)
    send_handle = symm_mem.rendezvous(sym_send, group.group_name)
    sources = [send_handle.get_buffer(p, (world, rows, dim), torch.bfloat16) for p in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world * max(a.split))]
    side = torch.cuda.Stream()
    if a.moe_tokens:
        import moekit

        torch.manual_seed(0)
        moe = moekit.MoE(dim, a.hidden, a.experts, a.top_k, bias=False, router_bias=False, activation="swiglu",
                         device="cuda", dtype=torch.bfloat16)
        tokens = torch.randn(a.moe_tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad_out = torch.randn(a.moe_tokens, dim, device="cuda", dtype=torch.bfloat16)
    else:
        x = torch.randn(a.gemm, a.gemm, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(a.gemm, a.gemm, device="cuda", dtype=torch.bfloat16)

    def nccl():
        dist.all_to_all_single(recv_nccl.view(world * rows, dim), send.view(world * rows, dim), group=group)

    def peer_copies(split):
        def run():
            cur = torch.cuda.current_stream()
            if a.pull:
                send_handle.barrier(channel=0)  # every rank's send buffer is ready to read
            blocks = [(p, i) for p in range(world) for i in range(split)]
            for (p, i), s in zip(blocks, streams, strict=False):
                s.wait_stream(cur)
                r0, r1 = rows * i // split, rows * (i + 1) // split
                with torch.cuda.stream(s):
                    if a.pull:  # rank p's slot for me, into my buffer
                        recv[p, r0:r1].copy_(sources[p][rank, r0:r1])
                    else:  # my slot for rank p, into rank p's buffer
                        peers[p][rank, r0:r1].copy_(send[p, r0:r1])
            for s in streams[: len(blocks)]:
                cur.wait_stream(s)
            handle.barrier(channel=0)  # every copy into (or out of) every buffer is done
        return run

    def work():  # what runs beside the exchange
        if a.moe_tokens:
            moe(tokens).backward(grad_out)
        else:
            torch.mm(x, y)

    def beside(exchange):
        def run():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                exchange()
            work()
            cur.wait_stream(side)
        return run

    nccl()
    ways = {"nccl": nccl} | {f"{'pull' if a.pull else 'push'} x{k}": peer_copies(k) for k in a.split}
    same = True
    for name, fn in ways.items():
        recv.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        fn()
        torch.cuda.synchronize()
        same = same and (name == "nccl" or torch.equal(recv, recv_nccl))
    res = {"work": _ms(work, a.reps)}
    for name, fn in ways.items():
        res[name] = _ms(fn, a.reps)
        res[name + " + work"] = _ms(beside(fn), a.reps)
    if rank == 0:
        mib = (world - 1) * rows * dim * 2 / 2**20
        flops = 2 * a.gemm**3 if not a.moe_tokens else 18 * a.moe_tokens * a.top_k * dim * a.hidden
        work = (f"MoE step T={a.moe_tokens} D={dim} F={a.hidden} E={a.experts} K={a.top_k}" if a.moe_tokens
                else f"matmul {a.gemm}^3")
        print(f"{torch.cuda.get_device_name()} x {world} | torch {torch.__version__} | {mib:.0f} MiB sent per rank "
              f"| {work} | received slots equal NCCL's: {same}")
        print(f"  {'MoE step' if a.moe_tokens else 'matmul'} alone: {res['work']:.3f} ms "
              f"({flops / res['work'] / 1e9:.0f} TF/s)")
        for name in ways:
            both = res[name + " + work"]
            print(f"  {name:12s} alone {res[name]:.3f} ms ({mib * 2**20 / res[name] / 1e6:.0f} GB/s per rank); "
                  f"with the work {both:.3f} ms (hidden {1 - (both - res['work']) / res[name]:.0%} of the "
                  f"exchange, work at {flops / max(both, res['work']) / 1e9:.0f} TF/s or better)")
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--gemm", type=int, default=8192)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--split", type=int, nargs="+", default=[1], help="row blocks per slot (a stream each)")
    p.add_argument("--pull", action="store_true", help="read the slots out of the peers' send buffers")
    p.add_argument("--moe-tokens", type=int, default=0, help="beside a moekit.MoE step of this many tokens")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(a.world, folder, a), nprocs=a.world)


if __name__ == "__main__":
    main()
