"""fused.optim.AdamW driven by accelerate and transformers as a user would: Accelerator.prepare with gradient
accumulation, accelerator.clip_grad_norm_ and save_state / load_state; transformers' Trainer with
optimizers=(fused AdamW, get_linear_schedule_with_warmup). Numbers against torch.optim.AdamW in the same run:
plain state within float32 rounding, bf16 and int8 state within a small fraction of the loss; checkpoints restore
the state bit for bit (8-bit codes and scales, bf16 moments) and the restored copy trains on identically."""

import pytest
import torch
from torch import nn

import fused

LR = 1e-2


def adamw(kind):
    if kind == "torch":
        return lambda params: torch.optim.AdamW(params, lr=LR)
    state_dtype = {"plain": None, "bf16": torch.bfloat16, "int8": "int8"}[kind]
    return lambda params: fused.optim.AdamW(params, lr=LR, state_dtype=state_dtype)


# the largest loss difference from torch.optim.AdamW's run allowed per state kind (measured: plain 1e-7, bf16 2e-4,
# int8 1.3e-3 on losses near 1)
LOSS_TOL = {"plain": 1e-5, "bf16": 2e-3, "int8": 5e-3}


def accelerate_run(tmp_path, accelerate, kind):
    """Trains a small MLP for 8 micro-batches (4 steps of 2), saves the state, trains 8 more; a fresh Accelerator
    loads the checkpoint and trains the same 8. Returns (first losses, later losses, the reloaded copy's losses,
    the optimizer state before and after the round trip)."""
    from accelerate.state import AcceleratorState, GradientState

    def new_accelerator():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)

    def model_and_data(acc):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(80, 64), nn.Tanh(), nn.Linear(64, 4))
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 80, generator=g), torch.randn(32, 4, generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
        return acc.prepare(model, adamw(kind)(model.parameters()), loader)

    def train(acc, model, opt, loader):
        losses = []
        for step, (x, y) in enumerate(loader):
            with acc.accumulate(model):
                loss = ((model(x) - y) ** 2).mean()
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                torch.manual_seed(100 + step)  # the low-bit state's rounding seed
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        return losses

    acc = new_accelerator()
    model, opt, loader = model_and_data(acc)
    first = train(acc, model, opt, loader)
    acc.save_state(str(tmp_path / kind))
    saved = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    later = train(acc, model, opt, loader)

    acc = new_accelerator()
    model, opt, loader = model_and_data(acc)
    acc.load_state(str(tmp_path / kind))
    restored = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    return first, later, train(acc, model, opt, loader), saved, restored


def test_accelerate_accumulate_clip_and_checkpoint(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    want, want_later, _, _, _ = accelerate_run(tmp_path, accelerate, "torch")
    for kind in ("plain", "bf16", "int8"):
        first, later, reloaded, saved, restored = accelerate_run(tmp_path, accelerate, kind)
        diff = max(abs(a - b) for a, b in zip(first + later, want + want_later))
        assert diff <= LOSS_TOL[kind], (kind, diff)
        assert reloaded == later, kind  # the same state and seeds: the same bits
        codes = {"plain": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[kind]
        assert saved[0]["exp_avg"].dtype == codes  # the 80 x 64 weight (5120 elements: quantized under int8)
        assert saved.keys() == restored.keys()
        for i in saved:
            assert saved[i].keys() == restored[i].keys()
            for k, v in saved[i].items():
                assert v.dtype == restored[i][k].dtype and torch.equal(v, restored[i][k]), (kind, i, k)


def trainer_run(tmp_path, transformers, kind):
    """Six steps of transformers' Trainer on a tiny random Llama (built here, nothing downloaded) with a linear
    warmup schedule; returns the logged (loss, grad_norm, learning_rate) per step."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    opt = adamw(kind)(model.parameters())
    schedule = transformers.get_linear_schedule_with_warmup(opt, 2, 8)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / kind),
        per_device_train_batch_size=4,
        max_steps=6,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, schedule))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in logs]


def test_transformers_trainer_with_scheduler(tmp_path):
    transformers = pytest.importorskip("transformers")
    want = trainer_run(tmp_path, transformers, "torch")
    assert len(want) == 6 and want[0][2] == 0.0 and want[2][2] == LR  # the warmup ran
    for kind in ("plain", "int8"):
        got = trainer_run(tmp_path, transformers, kind)
        assert [lr for _, _, lr in got] == [lr for _, _, lr in want]
        tol = LOSS_TOL[kind]
        for (loss, norm, _), (want_loss, want_norm, _) in zip(got, want):
            assert abs(loss - want_loss) <= tol and abs(norm - want_norm) <= 10 * tol, (kind, got, want)
