"""powernorm_transformer_lm: fairseq's transformer_lm with the norm flags, built
as fairseq-train builds it, and trained and scored through the real CLI."""

import argparse
import re

import pytest
import torch

from support import ROOT, TINY_LM, build_model, cli, sample
from powernorm_fairseq.common.errors import PowerNormConfigError
from powernorm_fairseq.models.powernorm_transformer_lm import powernorm_transformer_lm_wiki103
from powernorm_fairseq.norms import Norm, norm_type_of

pytestmark = pytest.mark.fast

USER_DIR = ROOT / "powernorm_fairseq"


def build(data, *flags, arch="powernorm_transformer_lm", seed=0):
    return build_model(data, "--task", "language_modeling", "--arch", arch, "--optimizer", "adam",
                       "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "5", "--dropout", "0",
                       "--tokens-per-sample", "32", "--sample-break-mode", "eos", *TINY_LM, *flags, seed=seed)


def kinds(model):
    return [norm_type_of(m) for m in model.modules() if isinstance(m, Norm)]


def test_ln_language_model_is_the_stock_pre_norm_transformer_lm(lm_data):
    # stock transformer_lm keeps its dataclass's 512 input/output dims whatever the
    # embedding size; powernorm_transformer_lm derives them as fairseq's base_lm_architecture does
    dims = ["--decoder-input-dim", "32", "--decoder-output-dim", "32"]
    ours, task = build(lm_data, "--norm-type", "ln", *dims)
    stock, _ = build(lm_data, "--decoder-normalize-before", *dims, arch="transformer_lm")
    assert ours.state_dict().keys() == stock.state_dict().keys()
    for key, value in stock.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    s = sample(task)
    ours.train(), stock.train()
    y_ours, y_stock = ours(**s["net_input"])[0], stock(**s["net_input"])[0]
    torch.testing.assert_close(y_ours, y_stock)


def test_norm_type_sets_every_norm_and_sublayer_flags_override(lm_data):
    model, _ = build(lm_data)
    assert kinds(model) == ["pn"] * 5  # 2 layers x (attention, FFN) + the final norm: PN by default
    model, _ = build(lm_data, "--norm-type", "bn", "--decoder-norm-ff", "power")
    layer = model.decoder.layers[0]
    assert (norm_type_of(layer.self_attn_layer_norm), norm_type_of(layer.final_layer_norm)) == ("bn", "pn")
    assert norm_type_of(model.decoder.layer_norm) == "bn"
    assert layer.encoder_attn_layer_norm is None


def test_norms_see_the_padding_of_sentence_batches(lm_data):
    """With --sample-break-mode eos the batch is padded; every norm gets the mask."""
    model, task = build(lm_data, "--norm-type", "pn")
    s = sample(task)
    tokens = s["net_input"]["src_tokens"]
    pad = tokens.eq(task.source_dictionary.pad())
    assert pad.any()
    seen = []
    for m in model.modules():
        if isinstance(m, Norm):
            m.register_forward_pre_hook(lambda norm, args: seen.append(norm.pad_mask))
    model.train()
    model(**s["net_input"])
    assert len(seen) == 5 and all(mask is not None and torch.equal(mask, pad) for mask in seen)


@pytest.mark.parametrize("kind", ["pn", "bn"])
def test_incremental_scoring_equals_full_scoring(lm_data, kind):
    model, task = build(lm_data, "--norm-type", kind)
    s = sample(task)
    model.train()
    for _ in range(3):  # move the running statistics away from their initial values
        model(**s["net_input"])[0].logsumexp(-1).sum().backward()
    model.eval()
    tokens = s["net_input"]["src_tokens"]
    with torch.no_grad():
        full = model(**s["net_input"])[0]
        state = {}
        steps = [model.decoder(tokens[:, :t + 1], incremental_state=state)[0][:, -1] for t in range(tokens.size(1))]
    real = tokens.ne(task.source_dictionary.pad())
    torch.testing.assert_close(torch.stack(steps, dim=1)[real], full[real], rtol=1e-4, atol=1e-4)


def test_wiki103_architecture_keeps_the_placement_flag():
    args = argparse.Namespace(norm_placement="post")
    powernorm_transformer_lm_wiki103(args)
    assert args.decoder_normalize_before is False and args.adaptive_input and args.decoder_layers == 16
    args = argparse.Namespace()
    powernorm_transformer_lm_wiki103(args)
    assert args.decoder_normalize_before is True and args.norm_type == args.decoder_norm_type == "pn"


def test_bad_language_model_flags(lm_data):
    with pytest.raises(PowerNormConfigError, match="--fixnorm needs tied embeddings: add "
                                                   "--share-decoder-input-output-embed$"):
        build(lm_data, "--fixnorm")
    with pytest.raises(PowerNormConfigError, match="--fixnorm replaces the word embeddings, --adaptive-input too"):
        build(lm_data, "--fixnorm", "--adaptive-input", "--share-decoder-input-output-embed")
    with pytest.raises(SystemExit):  # a language model has one side: no --decoder-norm-type
        build(lm_data, "--decoder-norm-type", "ln")


def perplexity(text):
    found = re.findall(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", text)
    assert found, text[-2000:]
    loss, ppl = map(float, found[-1])
    return loss, ppl


@pytest.mark.parametrize("norm", ["ln", "pn"])
@pytest.mark.slow
def test_train_and_evaluate_perplexity_through_the_cli(lm_data, lm_trained, norm):
    """fairseq-train then fairseq-eval-lm: the test-set perplexity is that of the
    reported loss and far below a uniform guess over the vocabulary."""
    save = lm_trained(norm)
    proc = cli("fairseq-eval-lm", lm_data, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
               "--gen-subset", "test", "--tokens-per-sample", "32", "--sample-break-mode", "eos",
               "--max-tokens", "512", "--num-workers", "0")
    loss, ppl = perplexity(proc.stdout + proc.stderr)
    assert ppl == pytest.approx(2 ** loss, abs=0.006)  # fairseq prints it rounded to 0.01
    vocab = sum(1 for _ in open(lm_data / "dict.txt")) + 4  # the symbols fairseq adds
    assert ppl < vocab / 4, (ppl, vocab)
    model = torch.load(save / "checkpoint_last.pt", weights_only=True)["cfg"]["model"]
    assert model.norm_type == norm and model.decoder_norm_type == norm


def test_checkpoint_with_other_norms_names_the_language_model_flag(lm_data):
    pn_model, _ = build(lm_data, "--norm-type", "pn")
    ln_model, _ = build(lm_data, "--norm-type", "ln")
    with pytest.raises(PowerNormConfigError, match=r"checkpoint norms \(decoder pn\) do not match the model "
                                                   r"\(decoder ln\); pass --norm-type pn$"):
        ln_model.load_state_dict(pn_model.state_dict())
    ln_model.load_state_dict(build(lm_data, "--norm-type", "ln", seed=1)[0].state_dict())


@pytest.mark.parametrize("kind", ["ln", "bn", "pn", "pn-v", "bn-original", "rmsnorm", "scalenorm", "none",
                                  "layernorm-simple", "detachnorm", "adanorm", "groupnorm"])
def test_normformer_flags_take_the_norm_type(lm_data, kind):
    """--scale-attn and --scale-fc (NormFormer) add norms of the kinds of the
    self-attention and FFN norms, which train with the others."""
    model, task = build(lm_data, "--norm-type", kind, "--scale-attn", "--scale-fc")
    layer = model.decoder.layers[0]
    assert norm_type_of(layer.attn_ln) == kind and norm_type_of(layer.ffn_layernorm) == kind
    assert layer.ffn_layernorm.dim == layer.fc1.out_features
    model.train()
    model(**sample(task)["net_input"])[0].logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.ffn_layernorm.parameters())
