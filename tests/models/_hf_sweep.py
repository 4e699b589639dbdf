"""The model sweep's cases and its worker: real transformers classes, built from tiny configs.

Each spec names a transformers class, a config builder (dropout 0, 2 layers, hidden 32,
vocab 128) and the inputs of a global batch, including whatever the model needs to
compute its own loss. `sweep` runs on every rank of one spawned world-2 process group:
first the single-process references (each rank trains half of them, so both cores
work), then, for every model, the plan, 2 full_shard AdamW steps and an export. Every
stage's error is recorded per model instead of raised, so one failing model does not
hide the others. Shardwise errors are deterministic, so both ranks fail at the same
point and stay in step.

Two references, and the rounding set. An attention key bias gets a gradient that is
zero in exact arithmetic (softmax ignores a shift shared by every key), so it receives
rounding noise, and Adam's normalised step turns noise into real updates with random
signs. Two correct single-process runs that only sum in another order (the whole batch
at once, or the ranks' two slices accumulated) already differ on such parameters by
10-100% of their (tiny) norm, so no run can match either at 1e-5. Each model therefore
trains both ways in one process (a per-slice loss, like CLIP's, only the second way).
A parameter on which they agree within RTOL/10 must match both at RTOL; one on which
they do not ("rounding-set": key biases, fused qkv biases, and the odd parameter
downstream of them) must lie within ROUNDING_FACTOR times their spread of the sliced
run, and the reloaded model's logits must still match.

Mixtures of experts train with their load-balancing loss on. That loss is formed from the
routing statistics of the whole batch (shardwise sums them over the ranks), so the sliced
reference forms it the same way, from every slice's router logits together; the routers'
first-step gradients are compared as well as the losses and final parameters.

Run as a script to print the Markdown results table: `python tests/models/_hf_sweep.py`.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.testing.parity import (
    ParityError,
    ParityReport,
    Trajectory,
    compare_trajectories,
    full_parameters,
)

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 128, 8, 4, 2, 1e-3
RTOL = 1e-5
WORLD = 2
# Measured: the distributed run lies within 5x the two single-process runs' spread.
ROUNDING_FACTOR = 10
IMAGE, LABELS = 16, 3


Inputs = dict[str, Any]


# --- inputs of one global batch -------------------------------------------------------


def _ids(g: torch.Generator, low: int = 4, length: int = SEQ) -> torch.Tensor:
    # Ids from 4 up keep clear of pad/bos/eos/unk, which some models treat specially.
    return torch.randint(low, VOCAB, (GLOBAL_BATCH, length), generator=g)


def causal_lm(g: torch.Generator) -> Inputs:
    ids = _ids(g)
    return {"input_ids": ids, "labels": ids}


def masked_lm(g: torch.Generator) -> Inputs:
    # A label at every position: a mean over -100-masked labels would weigh the ranks by
    # their masked-token counts and differ from the whole-batch mean.
    return {"input_ids": _ids(g), "labels": _ids(g)}


def seq2seq(g: torch.Generator) -> Inputs:
    return {"input_ids": _ids(g), "labels": _ids(g)}


def image_classification(g: torch.Generator) -> Inputs:
    pixels = torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE, generator=g)
    return {
        "pixel_values": pixels,
        "labels": torch.randint(0, LABELS, (GLOBAL_BATCH,), generator=g),
    }


def contrastive(g: torch.Generator) -> Inputs:
    pixels = torch.randn(GLOBAL_BATCH, 3, IMAGE, IMAGE, generator=g)
    return {"input_ids": _ids(g), "pixel_values": pixels, "return_loss": True}


def speech_seq2seq(g: torch.Generator, mel_bins: int = 16, frames: int = 16) -> Inputs:
    features = torch.randn(GLOBAL_BATCH, mel_bins, frames, generator=g)
    return {"input_features": features, "labels": _ids(g)}


def ctc(g: torch.Generator, samples: int = 400) -> Inputs:
    audio = torch.randn(GLOBAL_BATCH, samples, generator=g)
    return {"input_values": audio, "labels": torch.randint(1, 32, (GLOBAL_BATCH, 4), generator=g)}


# --- tiny configs (every dropout 0) ---------------------------------------------------

DECODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, attention_dropout=0.0,
)  # fmt: skip
MOE = dict(DECODER, num_experts_per_tok=2, output_router_logits=True)
AUX = "output_router_logits=True (the load-balancing loss)"
BERT_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip
BART_LIKE = dict(
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
    max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    encoder_layerdrop=0.0, decoder_layerdrop=0.0,
)  # fmt: skip
VIT_LIKE = dict(
    image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, num_labels=LABELS,
)  # fmt: skip
CLIP_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    vocab_size=VOCAB, max_position_embeddings=16, attention_dropout=0.0, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
CLIP_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    image_size=IMAGE, patch_size=4, attention_dropout=0.0,
)  # fmt: skip


def _config(name: str, **kwargs: Any) -> Callable[[], Any]:
    return functools.partial(getattr(tf, name), **kwargs)


@dataclass(frozen=True)
class Spec:
    name: str
    cls: str
    """The transformers class, built with `from_config` and reloaded with `from_pretrained`."""
    config: Callable[[], Any]
    inputs: Callable[[torch.Generator], Inputs]
    logits: str = "logits"
    """The output compared after reloading."""
    needed: str = ""
    """What the model needs beyond ids+labels (config fields, inputs, head), for the table."""
    loss_per_slice: bool = False
    """The loss is defined per (micro-)batch, as a contrastive loss over in-batch negatives
    is: the only reference is the ranks' slices accumulated in one process."""
    router: str = ""
    """A mixture of experts trained with its load-balancing loss on: the suffix of its
    routers' parameter names, whose first-step gradients are compared too. The sliced
    reference forms that loss from the statistics of the whole batch, as the ranks do."""

    def build(self) -> nn.Module:
        return getattr(tf, self.cls)(self.config())


SPECS = [
    Spec("gpt2", "GPT2LMHeadModel", _config(
        "GPT2Config", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
         causal_lm, needed="bos/eos ids inside the tiny vocab"),
    Spec("gpt_neox", "GPTNeoXForCausalLM", _config(
        "GPTNeoXConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=32,
        hidden_dropout=0.0, attention_dropout=0.0), causal_lm),
    Spec("llama", "LlamaForCausalLM", _config("LlamaConfig", **DECODER), causal_lm),
    Spec("mistral", "MistralForCausalLM", _config("MistralConfig", **DECODER), causal_lm),
    Spec("qwen2", "Qwen2ForCausalLM", _config("Qwen2Config", **DECODER), causal_lm),
    Spec("gemma", "GemmaForCausalLM", _config("GemmaConfig", **DECODER, head_dim=8), causal_lm,
         needed="head_dim=8 (default 256)"),
    Spec("phi", "PhiForCausalLM", _config(
        "PhiConfig", **DECODER, resid_pdrop=0.0, embd_pdrop=0.0), causal_lm),
    Spec("opt", "OPTForCausalLM", _config(
        "OPTConfig", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
        attention_dropout=0.0, layerdrop=0.0), causal_lm,
         needed="word_embed_proj_dim=hidden_size"),
    Spec("bloom", "BloomForCausalLM", _config(
        "BloomConfig", hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB,
        hidden_dropout=0.0, attention_dropout=0.0), causal_lm),
    Spec("bert", "BertForMaskedLM", _config("BertConfig", **BERT_LIKE), masked_lm,
         needed="labels at every position"),
    Spec("roberta", "RobertaForMaskedLM", _config("RobertaConfig", **BERT_LIKE), masked_lm,
         needed="labels at every position"),
    Spec("distilbert", "DistilBertForMaskedLM", _config(
        "DistilBertConfig", dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0), masked_lm,
         needed="labels at every position"),
    Spec("albert", "AlbertForMaskedLM", _config(
        "AlbertConfig", **BERT_LIKE, embedding_size=16, num_hidden_groups=1,
        classifier_dropout_prob=0.0), masked_lm,
         needed="labels at every position; one layer group shared by both layers"),
    Spec("electra", "ElectraForMaskedLM", _config(
        "ElectraConfig", **BERT_LIKE, embedding_size=16), masked_lm,
         needed="labels at every position (generator head)"),
    Spec("t5", "T5ForConditionalGeneration", _config(
        "T5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, vocab_size=VOCAB, dropout_rate=0.0, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0), seq2seq,
         needed="labels (decoder inputs shifted from them)"),
    Spec("bart", "BartForConditionalGeneration", _config("BartConfig", **BART_LIKE), seq2seq,
         needed="labels (decoder inputs shifted from them)"),
    Spec("vit", "ViTForImageClassification", _config("ViTConfig", **VIT_LIKE),
         image_classification, needed="pixel_values, class labels (num_labels=3)"),
    Spec("clip", "CLIPModel", _config(
        "CLIPConfig", text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=16),
         contrastive, logits="logits_per_image", loss_per_slice=True,
         needed="input_ids + pixel_values, return_loss=True; in-batch contrastive loss, so "
         "the reference averages the 2 slices' losses"),
    Spec("whisper", "WhisperForConditionalGeneration", _config(
        "WhisperConfig", vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=3, suppress_tokens=None,
        begin_suppress_tokens=None), speech_seq2seq,
         needed="input_features (16 mel bins × 2·max_source_positions frames), labels; "
         "special token ids inside the tiny vocab"),
    # More architectures, each a few hundred milliseconds.
    Spec("qwen3", "Qwen3ForCausalLM", _config("Qwen3Config", **DECODER, head_dim=8), causal_lm),
    Spec("gemma2", "Gemma2ForCausalLM", _config("Gemma2Config", **DECODER, head_dim=8),
         causal_lm, needed="head_dim=8"),
    Spec("gemma3", "Gemma3ForCausalLM", _config("Gemma3TextConfig", **DECODER, head_dim=8),
         causal_lm, needed="head_dim=8"),
    Spec("phi3", "Phi3ForCausalLM", _config(
        "Phi3Config", **DECODER, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), causal_lm, needed="pad/bos/eos ids inside the tiny vocab"),
    Spec("falcon", "FalconForCausalLM", _config(
        "FalconConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1,
        eos_token_id=2), causal_lm),
    Spec("gptj", "GPTJForCausalLM", _config(
        "GPTJConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=VOCAB,
        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0), causal_lm),
    Spec("gpt_neo", "GPTNeoForCausalLM", _config(
        "GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=4, vocab_size=VOCAB,
        max_position_embeddings=32, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0), causal_lm,
         needed="attention_types matching num_layers"),
    Spec("gpt_bigcode", "GPTBigCodeForCausalLM", _config(
        "GPTBigCodeConfig", n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
         causal_lm),
    Spec("codegen", "CodeGenForCausalLM", _config(
        "CodeGenConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=VOCAB,
        n_positions=32, n_ctx=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0), causal_lm),
    Spec("stablelm", "StableLmForCausalLM", _config(
        "StableLmConfig", **DECODER, hidden_dropout=0.0), causal_lm),
    Spec("olmo2", "Olmo2ForCausalLM", _config("Olmo2Config", **DECODER, eos_token_id=2),
         causal_lm),
    Spec("starcoder2", "Starcoder2ForCausalLM", _config(
        "Starcoder2Config", **DECODER, residual_dropout=0.0, embedding_dropout=0.0,
        bos_token_id=0, eos_token_id=0), causal_lm),
    # Mixtures of experts, each with its load-balancing loss on (transformers' default is
    # off) at the family's own coefficient.
    Spec("mixtral", "MixtralForCausalLM", _config(
        "MixtralConfig", **MOE, num_local_experts=4), causal_lm, router="mlp.gate.weight",
         needed=AUX),
    Spec("qwen2_moe", "Qwen2MoeForCausalLM", _config(
        "Qwen2MoeConfig", **MOE, num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32), causal_lm, router="mlp.gate.weight", needed=AUX),
    Spec("qwen3_moe", "Qwen3MoeForCausalLM", _config(
        "Qwen3MoeConfig", **MOE, head_dim=8, num_experts=4, moe_intermediate_size=32),
         causal_lm, router="mlp.gate.weight", needed=AUX + "; head_dim=8"),
    Spec("olmoe", "OlmoeForCausalLM", _config(
        "OlmoeConfig", **MOE, num_experts=4, eos_token_id=2), causal_lm,
         router="mlp.gate.weight", needed=AUX + "; eos id inside the tiny vocab"),
    Spec("granitemoe", "GraniteMoeForCausalLM", _config(
        "GraniteMoeConfig", **MOE, num_local_experts=4), causal_lm,
         router="block_sparse_moe.router.weight", needed=AUX),
    Spec("xlm_roberta", "XLMRobertaForMaskedLM", _config("XLMRobertaConfig", **BERT_LIKE),
         masked_lm, needed="labels at every position"),
    Spec("deberta_v2", "DebertaV2ForMaskedLM", _config("DebertaV2Config", **BERT_LIKE),
         masked_lm, needed="labels at every position"),
    Spec("modernbert", "ModernBertForMaskedLM", _config(
        "ModernBertConfig", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=32, local_attention=8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
         masked_lm, needed="labels at every position; special ids inside the tiny vocab"),
    Spec("mbart", "MBartForConditionalGeneration", _config("MBartConfig", **BART_LIKE), seq2seq,
         needed="labels (decoder inputs shifted from them)"),
    Spec("pegasus", "PegasusForConditionalGeneration", _config("PegasusConfig", **BART_LIKE),
         seq2seq, needed="labels (decoder inputs shifted from them)"),
    Spec("marian", "MarianMTModel", _config(
        "MarianConfig", **BART_LIKE, decoder_vocab_size=VOCAB, pad_token_id=0, eos_token_id=2,
        forced_eos_token_id=2, decoder_start_token_id=0), seq2seq,
         needed="labels; pad/decoder_start ids inside the tiny vocab"),
    Spec("mt5", "MT5ForConditionalGeneration", _config(
        "MT5Config", d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, vocab_size=VOCAB, dropout_rate=0.0, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0), seq2seq,
         needed="labels (decoder inputs shifted from them)"),
    Spec("deit", "DeiTForImageClassification", _config("DeiTConfig", **VIT_LIKE),
         image_classification, needed="pixel_values, class labels"),
    Spec("beit", "BeitForImageClassification", _config(
        "BeitConfig", **VIT_LIKE, drop_path_rate=0.0), image_classification,
         needed="pixel_values, class labels; drop_path_rate=0"),
    Spec("dinov2", "Dinov2ForImageClassification", _config(
        "Dinov2Config", image_size=IMAGE, patch_size=4, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, mlp_ratio=2, num_labels=LABELS), image_classification,
         needed="pixel_values, class labels"),
    Spec("swin", "SwinForImageClassification", _config(
        "SwinConfig", image_size=IMAGE, patch_size=2, embed_dim=16, depths=[1, 1],
        num_heads=[2, 2], window_size=4, drop_path_rate=0.0, num_labels=LABELS),
         image_classification, needed="pixel_values, class labels; drop_path_rate=0"),
    Spec("convnext", "ConvNextForImageClassification", _config(
        "ConvNextConfig", hidden_sizes=[8, 16], depths=[2, 2], num_stages=2, patch_size=2,
        image_size=IMAGE, num_labels=LABELS), image_classification,
         needed="pixel_values, class labels; num_stages=len(depths)"),
    Spec("siglip", "SiglipModel", _config(
        "SiglipConfig", text_config={**CLIP_TEXT, "pad_token_id": 1},
        vision_config=CLIP_VISION), contrastive, logits="logits_per_image", loss_per_slice=True,
         needed="input_ids + pixel_values, return_loss=True; in-batch sigmoid loss, so the "
         "reference averages the 2 slices' losses"),
    Spec("wav2vec2", "Wav2Vec2ForCTC", _config(
        "Wav2Vec2Config", vocab_size=32, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 4),
        conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean"), ctc,
         needed="input_values (raw audio), CTC labels; ctc_loss_reduction='mean' (the "
         "default 'sum' grows with the batch); mask_time_prob=0 (random SpecAugment)"),
]  # fmt: skip
BY_NAME = {s.name: s for s in SPECS}
CONTROL = "bert"
"""Also trained wrongly (every rank on rank 0's slice), to show the parity check fails."""


# --- running one model ----------------------------------------------------------------


def batches(spec: Spec) -> list[Inputs]:
    return [spec.inputs(torch.Generator().manual_seed(100 + step)) for step in range(STEPS)]


def rank_slice(inputs: Inputs, rank: int, world: int) -> Inputs:
    """This rank's contiguous share of every tensor in the global batch."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            per = value.shape[0] // world
            value = value[rank * per : (rank + 1) * per]
        out[key] = value
    return out


def checksum(model: nn.Module) -> float:
    """Fingerprint of the initial weights: both sides must start from the same model."""
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def eval_logits(model: nn.Module, spec: Spec) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(**batches(spec)[0])
    model.train()
    return getattr(out, spec.logits).detach().float().cpu().clone()


def _full_shard() -> shardwise.ParallelConfig:
    return shardwise.ParallelConfig(strategy="full_shard")


def plan_summary(model: nn.Module) -> dict[str, Any]:
    plan = shardwise.plan_wrap(model, _full_shard())
    return {
        "policy": plan.policy,
        "blocks": dict(Counter(u.module_class for u in plan if u.reason == "policy")),
        "units": [(u.fqn, u.module_class, u.reason) for u in plan],
        "tied": plan.tied,
        "notes": plan.notes,
    }


def train_single(spec: Spec, order: tuple[int, ...] | None) -> dict[str, Any]:
    """2 AdamW steps in this process alone. Each step's loss is one loss over the whole
    global batch (`order=None`) or the mean of the losses of the ranks' slices taken in
    `order`, backpropagated together: the arithmetic the ranks perform between them."""
    torch.manual_seed(0)
    model = spec.build()
    out: dict[str, Any] = {"init": checksum(model)}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step, batch in enumerate(batches(spec)):
        opt.zero_grad(set_to_none=True)
        if order is None:
            loss = model(**batch).loss
        else:
            loss = sliced_loss(spec, model, batch, order)
        loss.backward()
        if step == 0:
            out["router_grads"] = router_grads(spec, model)
        opt.step()
        losses.append(float(loss.detach()))
    out.update(losses=losses, params=full_parameters(model), logits=eval_logits(model, spec))
    return out


def sliced_loss(spec: Spec, model: nn.Module, batch: Inputs, order: tuple[int, ...]) -> Any:
    """The mean of the ranks' slices' losses; a mixture of experts' load-balancing loss
    from the routing statistics of the whole batch instead of each slice's (the family's
    own function on every slice's router logits, as the ranks compute it together)."""
    outputs = [model(**rank_slice(batch, r, WORLD)) for r in order]
    loss = sum(o.loss for o in outputs) / WORLD
    if not spec.router:
        return loss
    coef = model.router_aux_loss_coef
    own = sum(o.aux_loss for o in outputs) / WORLD
    whole = tuple(
        torch.cat(layer) for layer in zip(*(o.router_logits for o in outputs), strict=True)
    )
    family = sys.modules[type(model).__module__]
    aux = family.load_balancing_loss_func(whole, model.num_experts, model.num_experts_per_tok)
    return loss - coef * own + coef * aux


def router_grads(spec: Spec, model: nn.Module) -> dict[str, torch.Tensor]:
    """The routers' gradients, whole (every rank must call this on a sharded model)."""
    out = {}
    for name, p in shardwise.unwrap(model).named_parameters():
        if spec.router and name.endswith(spec.router):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = grad.detach().float().cpu().clone()
    return out


def reference(spec: Spec) -> dict[str, Any]:
    """The whole batch at once, and the ranks' slices accumulated: two single-process runs
    that differ only in the order of floating-point sums. A per-slice loss has no
    whole-batch run."""
    out = {"sliced": train_single(spec, tuple(range(WORLD)))}
    if not spec.loss_per_slice:
        out["whole"] = train_single(spec, None)
    return out


def distributed(
    spec: Spec, out_root: str, out: dict[str, Any], *, wrong_slices: bool = False
) -> None:
    """Plan, wrap with full_shard, 2 AdamW steps on this rank's slices, export; fills `out`
    stage by stage, so a failure leaves what came before it. `wrong_slices` (a negative
    control) gives every rank rank 0's slice and skips the export."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out["stage"] = "build"
    torch.manual_seed(0)
    model = spec.build()
    out["init"] = checksum(model)
    out["stage"] = "plan"
    out["plan"] = plan_summary(model)
    out["stage"] = "wrap"
    model = shardwise.wrap(model, _full_shard())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out["stage"] = "train"
    losses = []
    for step, batch in enumerate(batches(spec)):
        opt.zero_grad(set_to_none=True)
        loss = model(**rank_slice(batch, 0 if wrong_slices else rank, world)).loss
        loss.backward()
        if step == 0:
            out["router_grads"] = router_grads(spec, model)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # SUM; gloo has no AVG
        losses.append(float(total) / world)
    out["losses"] = losses
    out["stage"] = "gather"
    params = full_parameters(model)
    out["logits"] = eval_logits(model, spec)
    if rank == 0:
        out["params"] = params
    if wrong_slices:
        return
    out["stage"] = "export"
    target = Path(out_root) / spec.name
    # Files of at most 16 KiB: each model's export is sharded (an index and several
    # files), which from_pretrained must open as it opens a hub model's.
    shardwise.export_weights(model, target, max_shard_bytes=16 * 2**10)
    if rank == 0 and not (target / "config.json").exists():
        raise AssertionError(f"export_weights wrote no config.json into {target}")
    if rank == 0 and not (target / "model.safetensors.index.json").exists():
        raise AssertionError(f"the export in {target} is one file: the index path is untested")
    out["export_dir"] = str(target)
    out["stage"] = "done"


def _error(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def sweep(out_root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Every rank: its half of the references, then every model distributed."""
    # Many models return a view (logits.view(...)) from a unit's forward; FSDP2 warns that an
    # in-place op on it would skip the all-gather. None is done here, and parity would show it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict[str, Any]] = {name: {} for name in names}
    for i, name in enumerate(names):
        if i % world == rank:
            start = time.perf_counter()
            try:
                results[name]["reference"] = reference(BY_NAME[name])
            except Exception as exc:
                results[name]["reference"] = _error(exc)
            results[name]["reference_s"] = time.perf_counter() - start
    for name in names:
        start = time.perf_counter()
        dist_out: dict[str, Any] = {}
        try:
            distributed(BY_NAME[name], out_root, dist_out)
        except Exception as exc:
            dist_out.update(_error(exc))
        dist_out["seconds"] = time.perf_counter() - start
        results[name]["distributed"] = dist_out
    if CONTROL in results:
        control: dict[str, Any] = {}
        distributed(BY_NAME[CONTROL], out_root, control, wrong_slices=True)
        results[CONTROL]["control"] = control
    return results


def merge(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One record per model: the reference (from whichever rank ran it), rank 0's
    distributed result, and every rank's error."""
    merged: dict[str, dict[str, Any]] = {}
    for name in per_rank[0]:
        record: dict[str, Any] = {"errors": {}}
        for rank, results in enumerate(per_rank):
            if "reference" in results[name]:
                record["reference"] = results[name]["reference"]
                record["reference_s"] = results[name]["reference_s"]
            d = results[name]["distributed"]
            if "error" in d:
                record["errors"][rank] = (d["stage"], d["error"], d["traceback"])
        record["distributed"] = per_rank[0][name]["distributed"]
        if "control" in per_rank[0][name]:
            record["control"] = per_rank[0][name]["control"]
        merged[name] = record
    return merged


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def failure(record: dict[str, Any]) -> str | None:
    """The distributed run's error (with the rank that raised and the stage), or None."""
    if not record["errors"]:
        return None
    rank, (stage, error, trace) = next(iter(sorted(record["errors"].items())))
    ranks = sorted(record["errors"])
    return f"ranks {ranks} failed at {stage!r}: {error}\n--- rank {rank} traceback ---\n{trace}"


@dataclass
class Parity:
    vs_whole: ParityReport | None
    """Against the whole-batch run (None for a per-slice loss)."""
    vs_sliced: ParityReport
    """Against the ranks' slices accumulated in one process."""
    rounding: dict[str, tuple[float, float]]
    """Rounding-set parameters: (max abs diff between the two single-process runs, max
    abs diff of the distributed run from the sliced one)."""


def parity(record: dict[str, Any]) -> Parity:
    """Losses and final parameters, distributed vs both references; raises ParityError.

    A parameter on which the two single-process runs already disagree by more than
    RTOL/10 is set by rounding (see the module docstring): instead of RTOL, the distributed
    run must stay within ROUNDING_FACTOR times that disagreement of the sliced run.
    """
    ref, got = record["reference"], record["distributed"]
    if "error" in ref:
        raise RuntimeError(f"the single-process reference failed: {ref['traceback']}")
    whole, sliced = ref.get("whole"), ref["sliced"]
    if sliced["init"] != got["init"]:
        raise ParityError(f"initial weights differ: checksum {got['init']} vs {sliced['init']}")
    rounding: set[str] = set()
    if whole is not None:
        params = whole["params"].items()
        rounding = {n for n, p in params if rel(p, sliced["params"][n]) > RTOL / 10}
    reports: dict[str, ParityReport] = {}
    for label, run in (("vs whole batch", whole), ("vs slices", sliced)):
        if run is not None:
            reports[label] = compare_trajectories(
                Trajectory(run["losses"], _without(run["params"], rounding)),
                Trajectory(got["losses"], _without(got["params"], rounding)),
                rtol=RTOL,
                label=label,
            )
    for label, run in (("vs whole batch", whole), ("vs slices", sliced)):
        if run is not None:
            _compare_router_grads(run["router_grads"], got["router_grads"], label)
    bounded = {}
    for name in sorted(rounding):
        assert whole is not None
        spread = float((whole["params"][name] - sliced["params"][name]).abs().max())
        diff = float((got["params"][name] - sliced["params"][name]).abs().max())
        if not diff <= ROUNDING_FACTOR * spread:  # also catches NaN
            raise ParityError(
                f"{name!r} is set by rounding (the two single-process runs differ by up to "
                f"{spread:.1e}), but the distributed run is {diff:.1e} away from the sliced "
                f"one, more than {ROUNDING_FACTOR}x that"
            )
        bounded[name] = (spread, diff)
    return Parity(reports.get("vs whole batch"), reports["vs slices"], bounded)


def _compare_router_grads(
    want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], label: str
) -> None:
    if set(want) != set(got):
        raise ParityError(f"{label}: router gradients of {sorted(got)}, want {sorted(want)}")
    for name, grad in want.items():
        r = rel(got[name], grad)
        if not r <= RTOL:
            raise ParityError(
                f"{label}: the first step's gradient of {name!r} differs (rel {r:.2e} > "
                f"rtol {RTOL:.0e})"
            )


def _without(params: dict[str, torch.Tensor], names: Container[str]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in params.items() if k not in names}


def _reference_run(record: dict[str, Any]) -> dict[str, Any]:
    return record["reference"].get("whole") or record["reference"]["sliced"]


def reload(spec: Spec, record: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained on the export, then its logits against the reference's and the
    distributed model's final logits (relative norm differences)."""
    cls = getattr(tf, spec.cls)
    model, info = cls.from_pretrained(record["distributed"]["export_dir"], output_loading_info=True)
    logits = eval_logits(model, spec)
    return {
        "loading_info": {k: sorted(v) for k, v in info.items() if v},
        "vs_reference": rel(logits, _reference_run(record)["logits"]),
        "vs_distributed": rel(logits, record["distributed"]["logits"]),
    }


def _cell(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as exc:
        return f"FAIL: {type(exc).__name__}: {str(exc).splitlines()[0]}"


def _auto(record: dict[str, Any]) -> str:
    plan = record["distributed"].get("plan")
    if plan is None:
        return "(no plan)"
    blocks = ", ".join(f"{cls} × {n}" for cls, n in plan["blocks"].items())
    tied = sum(1 for u in plan["units"] if u[2] == "tied")
    return (blocks or "none: root only") + (f" (+{tied} tied unit)" if tied else "")


def _parity(spec: Spec, record: dict[str, Any]) -> str:
    error = failure(record)
    if error:
        return "FAIL: " + error.splitlines()[0]
    r = parity(record)
    sliced = max(r.vs_sliced.max_loss_rel, r.vs_sliced.max_param_rel)
    if r.vs_whole is None:
        return f"{sliced:.1e} vs slices (a per-slice loss: no whole-batch run)"
    whole = max(r.vs_whole.max_loss_rel, r.vs_whole.max_param_rel)
    text = f"{whole:.1e} vs whole, {sliced:.1e} vs slices"
    routers = record["distributed"].get("router_grads")
    if routers:
        want = record["reference"]["whole"]["router_grads"]
        worst_router = max(rel(g, want[n]) for n, g in routers.items())
        text += f"; routers' first gradients {worst_router:.1e} vs whole"
    if r.rounding:
        kinds = sorted({".".join(n.split(".")[-2:]) for n in r.rounding})
        worst = max(d for _, d in r.rounding.values())
        text += f"; rounding-set: {len(r.rounding)} ({', '.join(kinds)}; max abs {worst:.0e})"
    return text


def _reload(spec: Spec, record: dict[str, Any]) -> str:
    if record["distributed"].get("stage") != "done":
        return "(not exported)"
    r = reload(spec, record)
    extra = f" {r['loading_info']}" if r["loading_info"] else ""
    return f"{r['vs_reference']:.1e} vs ref, {r['vs_distributed']:.1e} vs dist{extra}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """The sweep as Markdown: one row per model."""
    rows = [
        "| model | class | auto found (block classes × count) | parity (max rel diff) "
        "| from_pretrained logits (rel diff) | what it needed |",
        "|---|---|---|---|---|---|",
    ]
    for name, record in results.items():
        spec = BY_NAME[name]
        cells = [
            _cell(lambda record=record: _auto(record)),
            _cell(lambda spec=spec, record=record: _parity(spec, record)),
            _cell(lambda spec=spec, record=record: _reload(spec, record)),
        ]
        rows.append(f"| {name} | {spec.cls} | {' | '.join(cells)} | {spec.needed} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile

    from shardwise.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_distributed(sweep, 2, args=(tmp, list(BY_NAME)), timeout_s=600)
        results = merge(per_rank)
        print(table(results))
        for name, r in results.items():
            print(
                name,
                f"reference {r.get('reference_s', 0):.2f}s",
                f"distributed {r['distributed']['seconds']:.2f}s",
            )
