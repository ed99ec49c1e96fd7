"""The powernorm_transformer model built the way fairseq-train builds it."""

import math

import pytest
import torch
from fairseq import options

from support import TINY, build_model, sample
from powernorm_fairseq.common.errors import PowerNormConfigError
from powernorm_fairseq.modules import FixNormEmbedding
from powernorm_fairseq.norms import NORM_TYPES, NORMS, Norm, norm_type_of
from powernorm_fairseq.norms.powernorm import PowerNorm

pytestmark = pytest.mark.fast


def build(data, *flags, arch="powernorm_transformer_iwslt_de_en", seed=0):
    return build_model(data, "--arch", arch, "--optimizer", "adam", "--lr-scheduler", "inverse_sqrt",
                       "--warmup-updates", "7", "--dropout", "0", *TINY, *flags, seed=seed)


def forward(model, s):
    return model(**s["net_input"])[0]


def norms_of(module):
    return [m for m in module.modules() if isinstance(m, Norm)]


def test_ln_model_is_the_stock_pre_norm_transformer(toy_data):
    ours, task = build(toy_data, "--norm-type", "ln", "--decoder-norm-type", "ln")
    stock, _ = build(toy_data, "--encoder-normalize-before", "--decoder-normalize-before",
                     arch="transformer_iwslt_de_en")
    assert ours.state_dict().keys() == stock.state_dict().keys()
    for key, value in stock.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    s = sample(task)
    ours.train(), stock.train()
    y_ours, y_stock = forward(ours, s), forward(stock, s)
    torch.testing.assert_close(y_ours, y_stock)
    y_ours.logsumexp(-1).sum().backward(), y_stock.logsumexp(-1).sum().backward()
    stock_grads = dict(stock.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, stock_grads[name].grad, msg=name)


@pytest.mark.parametrize("enc", NORM_TYPES)
@pytest.mark.parametrize("dec", ["ln", "pn", "bn"])
def test_every_norm_follows_the_flags(toy_data, enc, dec):
    model, task = build(toy_data, "--norm-type", enc, "--decoder-norm-type", dec)
    # fairseq's LayerNorm() returns torch's or apex's module; neither may be left
    assert not [m for m in model.modules() if "LayerNorm" in type(m).__name__ and not isinstance(m, Norm)]
    enc_norms, dec_norms = norms_of(model.encoder), norms_of(model.decoder)
    assert len(enc_norms) == 2 * 2 + 1 and len(dec_norms) == 3 * 2 + 1  # layers + final
    assert {norm_type_of(m) for m in enc_norms} == {enc}
    assert {norm_type_of(m) for m in dec_norms} == {dec}
    model.train()
    out = forward(model, sample(task))
    assert torch.isfinite(out).all()


def test_pn_flags_reach_the_layers(toy_data):
    model, _ = build(toy_data, "--norm-type", "pn", "--pn-alpha-fwd", "0.8", "--pn-alpha-bwd", "0.7",
                     "--pn-backward", "reference", "--pn-eps", "1e-4")
    pn = model.encoder.layers[0].self_attn_layer_norm
    assert isinstance(pn, PowerNorm)
    assert (pn.alpha_fwd, pn.alpha_bwd, pn.eps, pn.backward) == (0.8, 0.7, 1e-4, "reference")
    assert pn.warmup_updates == 7  # the run's --warmup-updates
    assert pn.layer_scale and pn.groups == 4  # on by default, groups = heads
    model, _ = build(toy_data, "--no-pn-group-scaling", "--pn-warmup-updates", "0")
    pn = model.encoder.layer_norm
    assert not pn.layer_scale and pn.warmup_updates == 0


def test_released_final_norm_warmup_in_reference_mode(toy_data):
    """The released code builds each side's final norm without a warmup
    argument (NormSelect's default, 1000); --pn-backward reference does too."""
    model, _ = build(toy_data, "--norm-type", "pn", "--decoder-norm-type", "pn", "--pn-backward", "reference")
    assert model.encoder.layers[0].final_layer_norm.warmup_updates == 7
    assert model.encoder.layer_norm.warmup_updates == model.decoder.layer_norm.warmup_updates == 1000
    model, _ = build(toy_data, "--norm-type", "pn")
    assert model.encoder.layer_norm.warmup_updates == 7


@pytest.mark.parametrize("kind", ["bn", "pn-v", "pn"])
def test_layer_scale_flag(toy_data, kind):
    """--layer-scale puts the paper's layer scale (groups = heads) before every
    batch-statistic norm; unset, only pn has it (--pn-group-scaling)."""
    def scaled(model):
        norms = [m for m in norms_of(model.encoder) if norm_type_of(m) == kind]
        flags = {m.layer_scale for m in norms}
        assert len(flags) == 1 and all(m.groups == 4 for m in norms)
        return flags.pop()

    assert scaled(build(toy_data, "--norm-type", kind)[0]) == (kind == "pn")
    assert scaled(build(toy_data, "--norm-type", kind, "--layer-scale")[0])
    assert not scaled(build(toy_data, "--norm-type", kind, "--no-layer-scale")[0])
    if kind == "pn":
        assert scaled(build(toy_data, "--norm-type", kind, "--layer-scale", "--pn-group-scaling")[0])
        with pytest.raises(PowerNormConfigError, match="--no-layer-scale contradicts --pn-group-scaling"):
            build(toy_data, "--norm-type", kind, "--no-layer-scale", "--pn-group-scaling")


def test_layernorm_simple_std_flag(toy_data):
    model, _ = build(toy_data, "--norm-type", "layernorm-simple", "--decoder-norm-type", "detachnorm",
                     "--layernorm-simple-std", "unbiased")
    assert {m.std for m in norms_of(model)} == {"unbiased"}
    model, _ = build(toy_data, "--norm-type", "layernorm-simple")
    assert {m.std for m in norms_of(model.encoder)} == {"biased"}


def test_post_norm_placement(toy_data):
    model, task = build(toy_data, "--norm-placement", "post", "--norm-type", "bn")
    assert model.encoder.layer_norm is None and model.decoder.layer_norm is None
    assert not model.encoder.layers[0].normalize_before
    assert not model.decoder.layers[0].normalize_before
    assert len(norms_of(model.encoder)) == 4
    model.train()
    assert torch.isfinite(forward(model, sample(task))).all()


@pytest.mark.parametrize("flags, message", [
    (["--norm-placement", "post", "--encoder-normalize-before"],
     "--encoder-normalize-before contradicts --norm-placement post"),
    (["--layernorm-embedding"], "--layernorm-embedding adds a LayerNorm"),
    (["--fixnorm"], "--fixnorm needs tied embeddings"),
])
def test_bad_combinations_are_rejected(toy_data, flags, message):
    with pytest.raises(PowerNormConfigError, match=message):
        build(toy_data, *flags)


def test_fixnorm(toy_data):
    model, task = build(toy_data, "--fixnorm", "--share-all-embeddings")
    emb = model.encoder.embed_tokens
    assert isinstance(emb, FixNormEmbedding) and emb is model.decoder.embed_tokens
    assert model.encoder.embed_scale == 1.0  # g replaces fairseq's sqrt(d) scale
    assert emb.weight.abs().max() <= 0.01
    lengths = emb.fixnorm_weight().norm(dim=-1)
    pad = task.source_dictionary.pad()
    torch.testing.assert_close(lengths[pad], torch.tensor(0.0))
    others = torch.cat([lengths[:pad], lengths[pad + 1:]])
    torch.testing.assert_close(others, torch.full_like(others, math.sqrt(32)))
    features = torch.randn(2, 3, 32)
    torch.testing.assert_close(model.decoder.output_layer(features), features @ emb.fixnorm_weight().t())


def test_small_init(toy_data):
    torch.manual_seed(0)
    model, _ = build(toy_data, "--small-init", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
                     "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512")
    attn = model.encoder.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.out_proj, model.decoder.layers[1].encoder_attn.v_proj):
        assert proj.weight.std().item() == pytest.approx(math.sqrt(2 / (5 * 256)), rel=0.05)
    for fc in (model.encoder.layers[1].fc1, model.decoder.layers[0].fc2):
        assert fc.weight.std().item() == pytest.approx(math.sqrt(2 / (256 + 512)), rel=0.05)


def test_checkpoint_with_other_norms_is_rejected(toy_data):
    pn_model, _ = build(toy_data, "--norm-type", "pn")
    ln_model, _ = build(toy_data, "--norm-type", "ln")
    with pytest.raises(PowerNormConfigError, match=r"checkpoint norms \(decoder ln, encoder pn\) .*"
                                                   r"model \(decoder ln, encoder ln\); pass --norm-type pn"):
        ln_model.load_state_dict(pn_model.state_dict())
    ln_model.load_state_dict(build(toy_data, "--norm-type", "ln", seed=1)[0].state_dict())


@pytest.mark.parametrize("dec", ["bn", "pn", "pn-v"])
def test_incremental_decoding_equals_full_scoring(toy_data, dec):
    model, task = build(toy_data, "--norm-type", "pn", "--decoder-norm-type", dec)
    s = sample(task)
    model.train()
    for _ in range(3):  # move the running statistics away from their initial values
        forward(model, s)
    model.eval()
    net = s["net_input"]
    with torch.no_grad():
        enc = model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
        full = model.decoder(net["prev_output_tokens"], encoder_out=enc)[0]
        state, steps = {}, []
        for t in range(net["prev_output_tokens"].size(1)):
            out = model.decoder(net["prev_output_tokens"][:, : t + 1], encoder_out=enc, incremental_state=state)
            steps.append(out[0])
    real = net["prev_output_tokens"].ne(task.target_dictionary.pad())
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], atol=1e-5, rtol=1e-4)


def test_registry_feeds_the_flag_choices(toy_data):
    with pytest.raises(SystemExit):
        build(toy_data, "--norm-type", "layer")
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(toy_data), "--arch", "powernorm_transformer_iwslt_de_en"])
    assert args.norm_type == "pn" and args.decoder_norm_type == "ln" and args.norm_placement == "pre"
    assert set(NORMS) == set(NORM_TYPES)


def test_per_sublayer_norms_override_the_side_types(toy_data):
    model, _ = build(toy_data, "--norm-type", "pn", "--decoder-norm-type", "ln",
                     "--encoder-norm-self", "batch", "--encoder-norm-ff", "rmsnorm",
                     "--decoder-norm-self", "power", "--decoder-norm-cross", "layer", "--decoder-norm-ff", "pn-v")
    for layer in model.encoder.layers:
        assert norm_type_of(layer.self_attn_layer_norm) == "bn"
        assert norm_type_of(layer.final_layer_norm) == "rmsnorm"
    for layer in model.decoder.layers:
        assert [norm_type_of(n) for n in (layer.self_attn_layer_norm, layer.encoder_attn_layer_norm,
                                          layer.final_layer_norm)] == ["pn", "ln", "pn-v"]
    assert norm_type_of(model.encoder.layer_norm) == "pn"  # the final norms follow the side's type
    assert norm_type_of(model.decoder.layer_norm) == "ln"
    plain, _ = build(toy_data, "--norm-type", "pn", "--decoder-norm-type", "ln")
    assert {norm_type_of(n) for n in norms_of(plain.encoder)} == {"pn"}


def test_sublayer_flag_rejects_unknown_spellings(toy_data):
    with pytest.raises(SystemExit):
        build(toy_data, "--encoder-norm-self", "layernorm")


@pytest.mark.parametrize("kind", ["bn", "pn", "pn-v", "bn-original"])
def test_incremental_decoding_equals_full_scoring_with_batch_norms_in_the_decoder(toy_data, kind):
    """Beam search feeds the decoder one position at a time; in eval mode the
    batch-statistic norms use running statistics, so each step's output equals
    the same position of a full-sequence forward."""
    model, task = build(toy_data, "--norm-type", kind, "--decoder-norm-type", kind)
    s = sample(task)
    model.train()
    for _ in range(3):  # move the running statistics away from their initial values
        forward(model, s).sum().backward()
    model.eval()
    net = s["net_input"]
    with torch.no_grad():
        full = forward(model, s)
        encoder_out = model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
        state = {}
        prev = net["prev_output_tokens"]
        steps = [model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)[0][:, -1]
                 for t in range(prev.size(1))]
    real = prev.ne(task.target_dictionary.pad())  # padded positions are not decoded step by step
    assert (~real).any()
    torch.testing.assert_close(torch.stack(steps, dim=1)[real], full[real], rtol=1e-4, atol=1e-4)


def test_bn_original_momentum_and_checkpoint_identity(toy_data):
    """bn-original keeps the released code's momentum 0.05 unless --norm-momentum
    says otherwise, and its checkpoints are told apart from plain bn's."""
    model, _ = build(toy_data, "--norm-type", "bn-original", "--decoder-norm-self", "bn")
    assert {n.momentum for n in norms_of(model.encoder)} == {0.05}
    assert model.decoder.layers[0].self_attn_layer_norm.momentum == 0.1
    model, _ = build(toy_data, "--norm-type", "bn-original", "--norm-momentum", "0.2")
    assert {n.momentum for n in norms_of(model.encoder)} == {0.2}
    bn_model, _ = build(toy_data, "--norm-type", "bn")
    with pytest.raises(PowerNormConfigError, match=r"checkpoint norms \(decoder ln, encoder bn-original\).*"
                                                   r"pass --norm-type bn-original"):
        bn_model.load_state_dict(model.state_dict())


@pytest.mark.parametrize("kind", ["bn", "pn-v", "pn", "bn-original"])
def test_checkpoint_activations_equals_a_run_without(toy_data, kind):
    """fairseq's --checkpoint-activations recomputes each layer's forward in
    the backward: the running statistics, the warmup counter and the
    gradients come out as without it, over steps inside and after PN's warmup."""
    runs = []
    for flags in ([], ["--checkpoint-activations"]):
        model, task = build(toy_data, "--norm-type", kind, "--decoder-norm-type", kind, "--pn-warmup-updates", "2",
                            *flags)
        model.train()
        for _ in range(3):
            model.zero_grad()
            forward(model, sample(task)).logsumexp(-1).sum().backward()
        runs.append(({k: v.clone() for k, v in model.state_dict().items()},
                     {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (state, grads), (state_ck, grads_ck) = runs
    assert state.keys() == state_ck.keys() and grads.keys() == grads_ck.keys()
    for key in state:
        torch.testing.assert_close(state_ck[key], state[key], rtol=1e-6, atol=1e-7, msg=key)
    for key in grads:
        torch.testing.assert_close(grads_ck[key], grads[key], rtol=1e-5, atol=1e-7, msg=key)


def test_norm_causal_reaches_the_decoder_norms_only(toy_data):
    model, _ = build(toy_data, "--norm-type", "bn", "--decoder-norm-type", "pn-v", "--norm-causal")
    assert all(m.causal for m in norms_of(model.decoder)) and not any(m.causal for m in norms_of(model.encoder))
    assert all(m.in_causal_decoder for m in norms_of(model.decoder))
