"""Peak memory of a GRPO step: full fine-tune with a reference copy, without a reference (beta = 0),
LoRA with the adapter-off reference, full fine-tune with gradient checkpointing, and full fine-tune
with ``model.fused_layers`` off (HF's own RMSNorm and MLP autograd); and under bfloat16 autocast with
the frozen reference (its Linear weights stored in bfloat16), without one, and with a reference
that moves (``algo.ref_sync_every``: kept float32; it never syncs in these few steps).

    .venv/bin/python benchmarks/bench_memory.py [--hidden 512 --layers 8 --vocab 32000 --steps 2]

One locally built Llama-architecture model (random weights, float32) is saved once; each variant
then runs `--steps` GRPO steps in its own child process, and reports the growth of its peak resident
set (VmHWM, which unlike ru_maxrss does not inherit the parent's peak) over its RSS after imports --
model, reference, optimizer state, activations. CPU only (on a GPU, torch.cuda.max_memory_allocated
is the number to read). Also prints what PPO's critic would add: a value model the size of the
policy, fp32 weights + grads + Adam moments; and the bytes autograd saves for the backward of one
forward over 16 rows x 64 tokens (parameters excluded), with and without ``fuse_layers``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import peak_rss_kib

VARIANTS = {
    "full fine-tune + reference copy (beta 0.04)": ["algo.beta=0.04"],
    "full fine-tune, no reference (beta 0)": ["algo.beta=0.0"],
    "LoRA r=16 + adapter-off reference (beta 0.04)": ["algo.beta=0.04", "model.lora={r: 16, alpha: 32}"],
    "full fine-tune + reference + gradient checkpointing": [
        "algo.beta=0.04",
        "model.gradient_checkpointing=true",
    ],
    "full fine-tune + reference, model.fused_layers off": ["algo.beta=0.04", "model.fused_layers=false"],
    # under autocast the frozen reference keeps its Linear weights in bfloat16 (float32 when it moves)
    "bfloat16 autocast: + reference (beta 0.04)": ["algo.beta=0.04", "model.autocast=bfloat16"],
    "bfloat16 autocast: no reference (beta 0)": ["algo.beta=0.0", "model.autocast=bfloat16"],
    "bfloat16 autocast: + float32 reference (ref_sync_every 1000)": [
        "algo.beta=0.04",
        "model.autocast=bfloat16",
        "algo.ref_sync_every=1000",
    ],
}


def child(model_dir: str, out_dir: str, sets: list[str], steps: int) -> dict:
    from grpokit.config import load_config
    from grpokit.train.trainer import GRPOTrainer

    base_kib = peak_rss_kib()
    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(64)]
    cfg = load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            f"train.output_dir={out_dir}",
            "train.quiet=true",
            f"train.max_steps={steps}",
            "train.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=32",
            "train.micro_batch_size=16",
            "train.save_every=0",
            "logging.report=false",
            "data.task=null",
            "data.path=unused.jsonl",
            *sets,
        ],
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(cfg, dataset=rows, rewards=[lambda p, c, **_: [float(len(x)) for x in c]])
    trainer.train()
    params = sum(p.numel() for p in trainer.model.parameters())
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    peak_kib = peak_rss_kib()
    return {
        "extra_peak_mib": (peak_kib - base_kib) / 1024,
        "seconds": time.perf_counter() - t0,
        "params": params,
        "trainable": trainable,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], json.loads(a.child[2]), a.steps)))
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=a.vocab,
            hidden_size=a.hidden,
            intermediate_size=int(a.hidden * 2.6875),
            num_hidden_layers=a.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
        model.save_pretrained(model_dir)
        ids = torch.randint(0, a.vocab, (16, 64), generator=torch.Generator().manual_seed(0))
        from grpokit.models.fused_layers import fuse_layers, saved_bytes

        plain = saved_bytes(model, ids) / 2**20
        fuse_layers(model)
        fused = saved_bytes(model, ids) / 2**20
        del model
        vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {chr(33 + i): i + 3 for i in range(90)}
        vocab |= {f"w{i}": i + 93 for i in range(a.vocab - 93)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
        ).save_pretrained(model_dir)
        rows = {}
        for name, sets in VARIANTS.items():
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--steps",
                    str(a.steps),
                    "--child",
                    str(model_dir),
                    str(Path(tmp) / f"run{len(rows)}"),
                    json.dumps(sets),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    params = next(iter(rows.values()))["params"]
    print(
        f"Llama, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: "
        f"{params / 1e6:.1f}M parameters, fp32; "
        f"{a.steps} GRPO steps of 4 prompts x 4 samples x 32 new tokens\n"
    )
    print("| variant | trainable params | extra peak RSS (MiB) | vs full + ref | time (s) |")
    print("|---|---:|---:|---:|---:|")
    ref = next(iter(rows.values()))["extra_peak_mib"]
    for name, r in rows.items():
        print(
            f"| {name} | {r['trainable'] / 1e6:.2f}M | {r['extra_peak_mib']:.0f} | "
            f"{r['extra_peak_mib'] / ref:.2f}x | {r['seconds']:.1f} |"
        )
    critic_mib = params * 16 / 2**20
    print(
        f"\nPPO's critic, for context (an estimate, not a run): a value model the size of the policy holds "
        f"{params / 1e6:.1f}M fp32 weights + grads + two Adam moments = 16 bytes/param = "
        f"{critic_mib:.0f} MiB, "
        "before its own activations; GRPO has none."
    )
    print(
        f"\nSaved for the backward of one forward over 16 x 64 tokens: {plain:.1f} MiB with HF's modules, "
        f"{fused:.1f} MiB with model.fused_layers ({fused / plain:.2f}x)"
    )


if __name__ == "__main__":
    main()
