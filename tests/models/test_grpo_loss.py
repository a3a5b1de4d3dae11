"""GRPO's loss pieces (toy.models.losses: group_advantages, grpo_token_losses,
grpo_loss_sum) against TRL 1.16's GRPOTrainer itself: its `_compute_loss` on hand-made
batches of a tiny LlamaForCausalLM (loss, gradients and clip/KL metrics, each loss_type,
beta 0 and 0.04, num_iterations 1 and 2, epsilon_high != epsilon), its advantages through
`_generate_and_score_completions` with generation mocked (each scale_rewards), and its
normalisation across gradient accumulation."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from toy.models.losses import group_advantages, grpo_loss_sum, grpo_token_losses  # noqa: E402

V, P, T, B, G = 64, 3, 6, 8, 4  # vocab, prompt and completion lengths, completions, group
EPS, EPS_HIGH = 0.2, 0.28
LENS = [6, 3, 5, 1, 6, 4, 2, 6]  # completion lengths up to and with EOS; the rest masked


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """TRL's GRPOTrainer over a tiny random Llama (hidden 32, 2 layers, vocab 64) and a
    word-level tokenizer, on the CPU. Built with beta 0 (beta > 0 would load a reference
    model by name); the tests set beta, loss_type and scale_rewards on it, as TRL reads
    them from the trainer in `_compute_loss`."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)

    def reward(prompts, completions, r, **kw):  # the dataset's column "r" is the reward
        return list(r)

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl-grpo")),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=T,
        epsilon=EPS,
        epsilon_high=EPS_HIGH,
        beta=0.0,
    )
    ds = Dataset.from_list([{"prompt": "t2 t3", "r": 0.0}] * B)
    tr = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok
    )
    tr.current_gradient_accumulation_steps = 1  # set by TRL's train loop, which we skip
    model.train()
    return tr


def batch(seed: int = 1) -> dict:
    """TRL's per-micro-batch inputs: left-padded prompts, completions masked after EOS."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_ids[0, 0], prompt_mask[0, 0] = 0, 0  # one short prompt, left-padded
    completion_ids = torch.randint(2, V, (B, T), generator=g)
    completion_mask = (torch.arange(T)[None] < torch.tensor(LENS)[:, None]).long()
    completion_ids[completion_mask == 0] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def policy_logps(model, inputs: dict) -> torch.Tensor:
    """(B, T) log p of each completion token under the model: a plain log-softmax and
    gather on the same tokens and attention mask TRL uses (its fused head is not ours)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=am).logits[:, P - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def noisy(logps: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Other log-probs on the same tokens (an older policy, a reference), 0 where masked
    as TRL's are; +-0.5 moves the ratio out of [0.8, 1.28] on both sides."""
    g = torch.Generator().manual_seed(seed)
    return (logps.detach() + torch.rand(logps.shape, generator=g) - 0.5) * mask


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize(
    "beta, correction", [(0.0, True), (0.04, True), (0.04, False)], ids=["beta0", "kl", "kl_plain"]
)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_gradients_and_metrics_equal_trls(
    trainer, loss_type, beta, correction, num_iterations
):
    """correction: TRL's use_bias_correction_kl (default True: the KL times the ratio,
    which changes the gradient even at num_iterations 1)."""
    model = trainer.model
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.args.use_bias_correction_kl = correction
    inputs = batch()
    mask = inputs["completion_mask"]
    with torch.no_grad():
        now = policy_logps(model, inputs)
    old = ref = None
    if num_iterations == 2:  # TRL then has the sampling policy's log-probs in the batch
        old = inputs["old_per_token_logps"] = noisy(now, mask, 2)
    if beta:
        ref = inputs["ref_per_token_logps"] = noisy(now, mask, 3)

    model.zero_grad(set_to_none=True)
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    theirs = theirs.detach()
    their_grads = grads(model)
    m = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    per_token, stats = grpo_token_losses(
        policy_logps(model, inputs),
        old,
        ref,
        inputs["advantages"],
        mask,
        EPS,
        EPS_HIGH,
        beta,
        kl_bias_correction=correction,
    )
    s, n = grpo_loss_sum(per_token, mask, loss_type, T)
    ours = s / n.clamp(min=1)
    ours.backward()
    ours = ours.detach()

    assert float(ours) == pytest.approx(float(theirs), abs=1e-5)
    for a, b in zip(grads(model), their_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for name in ("low", "high", "region"):
        assert float(stats[f"clip_ratio/{name}"]) == pytest.approx(m[f"clip_ratio/{name}_mean"])
    if num_iterations == 2:  # the clipping is exercised on both sides, not only ratio 1
        assert m["clip_ratio/low_mean"] > 0 and m["clip_ratio/high_mean"] > 0
    if beta:
        assert float(stats["kl"]) == pytest.approx(m["kl"], abs=1e-6) and m["kl"] > 0
    assert float(stats["tokens"]) == sum(LENS)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_tokens_after_eos_carry_nothing(loss_type):
    """Huge log-probs after a completion's EOS (mask 0) change neither the loss nor the
    gradients, and leave no NaN (exp of them, times a mask of 0, would)."""
    g = torch.Generator().manual_seed(4)
    mask = (torch.arange(T)[None] < torch.tensor(LENS)[:, None]).long()
    base = -torch.rand(B, T, generator=g) * 3
    old, ref = base - 0.3 * torch.rand(B, T, generator=g), base - 0.1
    adv = torch.randn(B, generator=g)
    out = []
    for junk in (0.0, 1e4, -1e4):
        lp = torch.where(mask.bool(), base, junk).requires_grad_()
        o, r = torch.where(mask.bool(), old, -junk), torch.where(mask.bool(), ref, junk)
        per_token, _ = grpo_token_losses(lp, o, r, adv, mask, EPS, EPS_HIGH, 0.04)
        s, n = grpo_loss_sum(per_token, mask, loss_type, T)
        (s / n).backward()
        assert torch.isfinite(lp.grad).all()
        out.append((float(s / n), lp.grad))
    for loss, grad in out[1:]:
        assert loss == out[0][0]
        torch.testing.assert_close(grad, out[0][1], atol=0, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trls(trainer, scale, monkeypatch):
    """TRL's advantage lines run inside `_generate_and_score_completions`; it is driven
    whole with `_generate` mocked (fixed prompt and completion ids) and the rewards read
    from a dataset column. The groups: spread rewards, equal rewards (std 0), and one
    unscored completion (None: left out of its group and given advantage 0)."""
    rewards = [1.0, 0.0, 0.5, 2.0, 0.3, 0.3, 0.3, 0.3, -1.0, None, 4.0, 0.0]
    n = len(rewards)
    comp = [[5 + i % 7] * (1 + i % 3) + [1] for i in range(n)]
    monkeypatch.setattr(
        trainer,
        "_generate",
        lambda prompts: ([[2, 3]] * n, comp, None, ["x"] * n, None, {}, None, None),
    )
    trainer.scale_rewards, trainer.beta = scale, 0.0
    out = trainer._generate_and_score_completions([{"prompt": "t2 t3", "r": r} for r in rewards])
    r = torch.tensor([torch.nan if x is None else x for x in rewards])
    ours = group_advantages(r, G, scale)
    torch.testing.assert_close(ours, out["advantages"], atol=1e-6, rtol=0)
    assert ours[9] == 0 and (ours[4:8] == 0).all()


def test_group_advantages_formula():
    """The std is the unbiased one (n - 1) plus 1e-4, and "batch" keeps the GROUP's mean."""
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 14.0])
    a = group_advantages(r, 4, "group")
    assert float(a[0]) == pytest.approx(-1.5 / (torch.tensor([0.0, 1, 2, 3]).std() + 1e-4))
    b = group_advantages(r, 4, "batch")
    assert float(b[4]) == pytest.approx(-1.0 / (float(r.std()) + 1e-4))
    assert torch.equal(group_advantages(r, 4, "none"), r - torch.tensor([1.5] * 4 + [11.0] * 4))
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(r, 4, "std")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_accumulation_normalisation(trainer, loss_type):
    """Two micro-batches of four completions with different token counts (15 and 18), one
    optimizer step (gradient_accumulation_steps = steps_per_generation = 2). toy divides the
    step's summed sums by its summed counts; TRL sums its micro-batch losses, each already
    divided for accumulation. dapo, grpo and dr_grpo agree; bnpo is TRL's mean of the two
    micro-batches' token means, toy's the step's token mean (the docstring's difference)."""
    model = trainer.model
    trainer.loss_type, trainer.beta = loss_type, 0.0
    trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation = 2, 2
    inputs = batch(5)
    total = inputs["completion_mask"].sum()
    parts, theirs = [], 0.0  # toy's (sum, count) per micro-batch; TRL's summed losses
    try:
        with torch.no_grad():
            for half in (slice(0, 4), slice(4, 8)):
                mb = {k: v[half] for k, v in inputs.items() if k != "num_items_in_batch"}
                mb["num_items_in_batch"] = total  # TRL's: the whole generation batch's tokens
                theirs += float(trainer._compute_loss(model, mb))
                per_token, _ = grpo_token_losses(
                    policy_logps(model, mb), None, None, mb["advantages"], mb["completion_mask"]
                )
                parts.append(grpo_loss_sum(per_token, mb["completion_mask"], loss_type, T))
    finally:
        trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation = 1, 1
    ours = float(sum(s for s, _ in parts) / sum(n for _, n in parts))
    assert [float(n) for _, n in parts] == {
        "grpo": [4, 4],
        "dr_grpo": [4 * T, 4 * T],
    }.get(loss_type, [sum(LENS[:4]), sum(LENS[4:])])
    if loss_type == "bnpo":
        assert theirs == pytest.approx(sum(float(s / n) for s, n in parts) / 2, abs=1e-6)
        assert abs(ours - theirs) > 1e-3
    else:
        assert ours == pytest.approx(theirs, abs=1e-6)
