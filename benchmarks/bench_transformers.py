"""One training step (forward, backward, optimizer step) of a random-config Llama-style transformers model:
fused.patch + fused.optim.AdamW vs eager + torch AdamW vs torch.compile(eager model) + torch AdamW. Tokens/s
(median over interleaved rounds) and the peak memory one step allocates.

    python -m benchmarks.bench_transformers                       # hidden 1024, 4 layers, vocab 32000, 4 x 512
    python -m benchmarks.bench_transformers --hidden 512 --layers 2 --seq 256 --batch 2   # a quicker size
"""

import argparse
import copy
import json
import os
import statistics
import time

import torch

import fused
from benchmarks.timing import device_name, peak_memory_mb


def build(args, device):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 256 or 1,
        max_position_embeddings=max(2048, args.seq),
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=args.dtype).train()


def variants(args, device):
    eager = build(args, device)
    patched = fused.patch(copy.deepcopy(eager))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    return {
        "eager": (eager, torch.optim.AdamW(eager.parameters(), lr=1e-4)),
        "fused.patch": (patched, fused.optim.AdamW(patched.parameters(), lr=1e-4)),
        "torch.compile": (compiled, torch.optim.AdamW(compiled_model.parameters(), lr=1e-4)),
    }


def step_fn(model, opt, ids, device):
    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return step


def cases(device: str, quick: bool) -> list:
    """make bench's cases: one training step at sizes the CPU times in seconds (main() takes the issue's size)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    # (hidden, layers, vocab, seq): make bench's default first (a step in a fraction of a second on a 2-core CPU,
    # most of the case's time the compile), then the larger size FULL=1 adds
    sizes = [(128, 1, 512, 32)] if quick else [(256, 2, 8192, 128), (512, 2, 32000, 256)]
    out = []
    for i, (hidden, layers, vocab, seq) in enumerate(sizes):
        args = argparse.Namespace(hidden=hidden, layers=layers, vocab=vocab, seq=seq, batch=2, dtype=torch.float32)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        impls = {name: step_fn(model, opt, ids, device) for name, (model, opt) in variants(args, device).items()}
        shape = f"hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, {args.batch}x{args.seq} tokens"
        out.append({"name": f"Llama training step ({shape}) float32", "impls": impls, "default": i == 0})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per variant, interleaved")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default="benchmarks/results/transformers")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    steps = {name: step_fn(model, opt, ids, device) for name, (model, opt) in variants(args, device).items()}
    for step in steps.values():  # warm-up: compilation, allocator, optimizer state
        step()
        step()
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    rows = []
    for name, step in steps.items():
        rows.append(
            dict(
                variant=name,
                tokens_per_s=tokens / statistics.median(times[name]),
                peak_mb=peak_memory_mb(step, device),
            )
        )
    base = rows[0]
    shape = f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, batch {args.batch} x seq {args.seq}"
    lines = [
        f"# One training step, Llama-style ({shape}, {str(args.dtype)[6:]})",
        "",
        f"{device_name(device)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, median of {args.rounds}",
        "",
        "| variant | tokens/s | x eager | peak MB | x eager |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f} "
            f"| {row['peak_mb']:.0f} | {row['peak_mb'] / base['peak_mb']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"transformers_{device}")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(dict(device=device_name(device), shape=shape, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
