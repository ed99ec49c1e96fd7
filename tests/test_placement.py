"""``--norm-placement``: each placement's forward against plain PyTorch, its
refusals, and training, checkpoints, generation and the hub with each."""

import math

import pytest
import torch
import torch.nn.functional as F

from support import TINY, TINY_LM, USER_DIR, build_model, cli, losses, sample, train_args
from powernorm_fairseq.common.errors import PowerNormConfigError
from powernorm_fairseq.norms.placement import PLACEMENTS, deepnorm_constants
from powernorm_fairseq.norms import NORM_TYPES, Norm
from powernorm_fairseq.norms.qk_norm import QK_KINDS

pytestmark = pytest.mark.fast

#: each placement with the norm kinds it builds (rezero has none)
KINDS = {p: ("none" if p == "rezero" else "ln") for p in PLACEMENTS}


def build(data, placement, *flags, arch="powernorm_transformer_iwslt_de_en"):
    kind = KINDS[placement]
    return build_model(data, "--arch", arch, "--optimizer", "adam", "--lr-scheduler", "inverse_sqrt",
                       "--warmup-updates", "7", "--dropout", "0", *TINY, "--norm-placement", placement,
                       "--norm-type", kind, "--decoder-norm-type", kind, *flags, seed=0)


def attention(x, pad, a):
    """fairseq's self-attention in plain PyTorch, float64: (T, B, C), heads of a."""
    T, B, C = x.shape
    H, D = a.num_heads, C // a.num_heads

    def heads(t):
        return t.reshape(T, B * H, D).transpose(0, 1)  # (B H, T, D)

    def qk(p):  # --qk-norm ln: LayerNorm over each head's channels, or (--qk-norm-scope projection) all of them
        t = F.linear(x, p.weight, p.bias)
        if hasattr(p, "norm"):
            d = p.norm.weight.numel()
            t = F.layer_norm(t.view(T, B, C // d, d), (d,), p.norm.weight, p.norm.bias, p.norm.eps).view(T, B, C)
        return t

    q = heads(qk(a.q_proj) * D ** -0.5)
    k, v = heads(qk(a.k_proj)), heads(F.linear(x, a.v_proj.weight, a.v_proj.bias))
    scores = (q @ k.transpose(1, 2)).view(B, H, T, T).masked_fill(pad[:, None, None, :], float("-inf"))
    # fairseq's attention through its projections (QK-norm) takes its softmax in float32 (utils.softmax)
    weights = scores.view(B * H, T, T).softmax(-1, dtype=torch.float32 if hasattr(a.q_proj, "norm") else None)
    out = weights.to(v) @ v
    return F.linear(out.transpose(0, 1).reshape(T, B, C), a.out_proj.weight, a.out_proj.bias)


def reference_encoder(encoder, x, pad, placements, depth_scaling=False):
    """The encoder's layers and its final norm, each layer's placement written out (placement.py's
    docstring); ``placements``: one per layer; ``depth_scaling``: LayerNorm Scaling's 1/sqrt(l)."""
    def norm(module, h):
        if type(module).__name__ == "RMSNorm":
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eps) * module.weight
        return F.layer_norm(h, h.shape[-1:], module.weight, module.bias, module.eps)

    for depth, (layer, placement) in enumerate(zip(encoder.layers, placements), 1):
        scale = depth ** -0.5 if depth_scaling and placement in ("pre", "sandwich") else 1.0
        sublayers = [(lambda h: attention(h, pad, layer.self_attn), layer.self_attn_layer_norm),
                     (lambda h: layer.fc2(F.relu(layer.fc1(h))), layer.final_layer_norm)]
        for i, (f, n) in enumerate(sublayers):
            if placement == "pre":
                x = x + f(scale * norm(n, x))
            elif placement == "post":
                x = norm(n, x + f(x))
            elif placement == "sandwich":
                x = x + norm(layer.output_norms[i], f(scale * norm(n, x)))
            elif placement == "output":
                x = x + norm(layer.output_norms[i], f(x))
            elif placement == "deepnorm":
                alpha = deepnorm_constants(2, 2)["encoder"][0]
                x = norm(n, alpha * x + f(x))
            else:  # rezero: a gate per sublayer, or one per layer (--rezero-gates layer)
                x = x + layer.rezero_gates[i if layer.rezero_gates.numel() > 1 else 0] * f(x)
    return norm(encoder.layer_norm, x) if placements[-1] in ("pre", "sandwich", "output") else x


#: the placement of each of the two layers a case's flags give
LAYERS = {**{p: [p, p] for p in PLACEMENTS}, "mixln": ["pre", "pre"]}  # a quarter of 2 layers rounded down: 0


@pytest.mark.parametrize("placement, flags, layers", [(p, [], LAYERS[p]) for p in PLACEMENTS] + [
    ("pre", ["--qk-norm", "ln"], None), ("deepnorm", ["--qk-norm", "ln"], None),
    ("pre", ["--qk-norm", "ln", "--qk-norm-scope", "projection"], None), ("rezero", ["--rezero-gates", "layer"], None),
    ("output", ["--qk-norm", "ln"], None),
    ("mixln", ["--mixln-post-layers", "1"], ["post", "pre"]),
    ("pre", ["--norm-depth-scaling"], None), ("sandwich", ["--norm-depth-scaling"], None),
    ("mixln", ["--mixln-post-layers", "1", "--norm-depth-scaling"], ["post", "pre"]),
    ("post", ["--encoder-layer-placements", "output,post"], ["output", "post"]),
    ("pre", ["--encoder-layer-placements", "post,sandwich", "--norm-depth-scaling",
             "--encoder-layer-norms", "rmsnorm,ln"], ["post", "sandwich"])])
def test_two_encoder_layers_compute_their_placement(toy_data, placement, flags, layers):
    model, _ = build(toy_data, placement, *flags)
    layers = layers or LAYERS[placement]
    qk = type(model.encoder.layers[0].self_attn.q_proj).__name__ == "HeadNormProjection"
    assert qk == ("--qk-norm" in flags)
    if qk:  # a head's channels, or the whole projection's
        assert model.encoder.layers[0].self_attn.q_proj.norm.weight.numel() == (32 if "projection" in flags else 8)
    if placement == "rezero":
        assert model.encoder.layers[0].rezero_gates.numel() == (1 if "layer" in flags else 2)
    if "--encoder-layer-norms" in flags:
        assert [type(layer.final_layer_norm).__name__ for layer in model.encoder.layers] == ["RMSNorm", "LayerNorm"]
    model = model.double().eval()
    encoder = model.encoder
    with torch.no_grad():  # parameters off their start, so that gates and gains are seen
        for p in encoder.layers.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 32, generator=g, dtype=torch.float64)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    y = x
    for layer in encoder.layers:
        y = layer(y, pad)
    y = encoder.layer_norm(y) if encoder.layer_norm is not None else y
    want = reference_encoder(encoder, x, pad, layers, "--norm-depth-scaling" in flags)
    real = ~pad.t()
    torch.testing.assert_close(y[real], want[real], rtol=1e-10, atol=1e-10)


def test_each_placement_builds_its_own_parts(toy_data):
    parts = {}
    for placement in PLACEMENTS:
        model, _ = build(toy_data, placement)
        layer, dec = model.encoder.layers[0], model.decoder.layers[0]
        parts[placement] = (layer.normalize_before, model.encoder.layer_norm is not None,
                            len(getattr(layer, "output_norms", ())), len(getattr(dec, "output_norms", ())),
                            tuple(getattr(dec, "rezero_gates", torch.ones(0)).shape), layer.residual_scale)
    alpha_enc = 0.81 * (2 ** 4 * 2) ** (1 / 16)
    assert parts == {"pre": (True, True, 0, 0, (0,), 1.0), "post": (False, False, 0, 0, (0,), 1.0),
                     "sandwich": (True, True, 2, 3, (0,), 1.0), "deepnorm": (False, False, 0, 0, (0,), alpha_enc),
                     "rezero": (False, False, 0, 0, (3,), 1.0), "output": (True, True, 2, 3, (0,), 1.0),
                     "mixln": (True, True, 0, 0, (0,), 1.0)}
    model, _ = build(toy_data, "output")
    assert {type(layer.self_attn_layer_norm).__name__ for layer in model.encoder.layers} == {"NoNorm"}
    model, _ = build(toy_data, "rezero")
    assert all(type(m).__name__ == "NoNorm" for m in model.modules() if isinstance(m, Norm))
    assert all(not g.any() for layer in model.encoder.layers for g in layer.rezero_gates)


def test_deepnorm_constants_and_initialisation(toy_data):
    """DeepNet's Figure 2: alpha and beta per model kind, and the Xavier-normal gains."""
    assert deepnorm_constants(6, 0) == {"encoder": ((12) ** 0.25, 48 ** -0.25)}
    assert deepnorm_constants(0, 6) == {"decoder": ((12) ** 0.25, 48 ** -0.25)}
    both = deepnorm_constants(6, 6)
    assert both["decoder"] == (18 ** 0.25, 72 ** -0.25)
    assert math.isclose(both["encoder"][0], 0.81 * (6 ** 5) ** (1 / 16))
    model, _ = build(toy_data, "deepnorm", "--encoder-layers", "6", "--decoder-layers", "6",
                     "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512")
    beta = both["encoder"][1]
    fc = torch.cat([layer.fc1.weight.flatten() for layer in model.encoder.layers])
    q = torch.cat([layer.self_attn.q_proj.weight.flatten() for layer in model.encoder.layers])
    xavier = math.sqrt(2 / (32 + 512))
    assert abs(fc.std().item() / (beta * xavier) - 1) < 0.05
    assert abs(q.std().item() / math.sqrt(2 / 64) - 1) < 0.05
    assert model.decoder.layers[0].residual_scale == both["decoder"][0]


@pytest.mark.parametrize("flags, message", [
    (["--norm-placement", "rezero"], "--norm-placement rezero has no norms in its layers .* pass --norm-type none"),
    (["--norm-placement", "rezero", "--norm-type", "none"], "not ln"),  # the decoder's ln
    (["--norm-placement", "deepnorm", "--init", "smallinit"], "--init smallinit contradicts --norm-placement deepnorm"),
    (["--norm-placement", "deepnorm", "--init", "xavier-kaiming"], None),  # the embeddings' init, beside DeepNet's
    (["--norm-placement", "sandwich", "--encoder-normalize-before"], None),  # sandwich is pre-norm: agrees
    (["--qk-norm", "rmsnorm", "--norm-placement", "post"], None),
    (["--qk-norm", "pn"], "--qk-norm pn: the norm of each head's queries and keys must take one vector at a time"),
    (["--qk-norm", "groupnorm"], "--qk-norm groupnorm: .* choose one of ln, scalenorm, rmsnorm"),
    (["--norm-placement", "deepnorm", "--decoder-normalize-before"],
     "--decoder-normalize-before contradicts --norm-placement deepnorm"),
    (["--mixln-post-layers", "1"], "--mixln-post-layers 1: Mix-LN's split, and --norm-placement pre is none"),
    (["--norm-placement", "mixln", "--mixln-post-layers", "2"], "leaves no pre-norm layer in the encoder, of 2"),
    (["--encoder-layer-norms", "ln*3"], r"--encoder-layer-norms ln\*3 names 3 layers: the encoder has 2"),
    (["--decoder-layer-placements", "post"], "--decoder-layer-placements post names 1 layers: the decoder has 2"),
    (["--encoder-layer-norms", "bn,ln", "--encoder-norm-ff", "pn"], "--encoder-norm-ff .* use one of them"),
    (["--encoder-layer-placements", "pre,post", "--norm-placement", "deepnorm"], "sets every layer itself"),
    (["--norm-depth-scaling", "--norm-placement", "post"], "--norm-depth-scaling scales the norm before each"),
    (["--norm-depth-scaling", "--norm-placement", "post", "--decoder-layer-placements", "post,pre"], None),
    (["--norm-placement", "rezero", "--norm-type", "none", "--decoder-norm-type", "none", "--decoder-layer-norms",
      "none,ln"], "not ln"),
    (["--encoder-layer-norms", "bn,rbn", "--checkpoint-activations"], "rbn's penalty needs the graph of each"),
    (["--norm-type", "rbn", "--norm-placement", "output", "--rbn-penalty-var", "0"], None),
])
def test_combinations_train_or_are_refused_in_one_line(toy_data, flags, message):
    if message is None:
        build_model(toy_data, "--arch", "powernorm_transformer_iwslt_de_en", *TINY, *flags)
        return
    with pytest.raises(PowerNormConfigError, match=message):
        build_model(toy_data, "--arch", "powernorm_transformer_iwslt_de_en", *TINY, *flags)


@pytest.mark.slow
@pytest.mark.parametrize("placement, qk", [(p, None) for p in PLACEMENTS] + [("pre", "rmsnorm")])
def test_fairseq_train_generate_and_the_hub_with_each_placement(toy_data, tmp_path, placement, qk):
    """Training, beam search (incremental decoding, with QK-norm's cached keys) and the hub."""
    from fairseq.models.transformer import TransformerModel

    kind = KINDS[placement] if placement == "rezero" else "pn"
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-placement", placement, "--norm-type", kind,
                                            "--decoder-norm-type", KINDS[placement],
                                            *(["--qk-norm", qk] if qk else []), max_update=6))
    trained = losses(proc.stdout + proc.stderr)
    assert len(trained) == 6 and all(math.isfinite(v) for v in trained), trained
    gen = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", tmp_path / "checkpoint_last.pt",
              "--beam", "2", "--max-len-b", "5", "--batch-size", "8")
    assert "Generate test with beam=2: BLEU4" in gen.stdout
    hub = TransformerModel.from_pretrained(str(tmp_path), checkpoint_file="checkpoint_last.pt",
                                           data_name_or_path=str(toy_data), user_dir=USER_DIR)
    assert hub.cfg.model.norm_placement == placement and hub.cfg.model.qk_norm == qk
    assert isinstance(hub.translate("haus baum katze"), str)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_language_model_and_the_classifier_take_each_placement(lm_data, toy_data, placement):
    """Decoder-only and encoder-only: DeepNorm's constants of their kind, a forward that stays finite."""
    kind = KINDS[placement]
    lm, _ = build_model(lm_data, "--task", "language_modeling", "--arch", "powernorm_transformer_lm",
                        "--tokens-per-sample", "32", "--sample-break-mode", "eos", *TINY_LM,
                        "--norm-placement", placement, "--norm-type", kind)
    tokens = torch.randint(4, 20, (2, 6))
    assert torch.isfinite(lm(tokens)[0]).all()
    assert lm.decoder.layers[0].residual_scale == (deepnorm_constants(0, 2)["decoder"][0]
                                                   if placement == "deepnorm" else 1.0)
    assert (lm.decoder.layer_norm is not None) == (placement in ("pre", "sandwich", "output", "mixln"))
    classifier, _ = build_model(toy_data, "--task", "translation", "--arch", "powernorm_classifier",
                                "--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim",
                                "64", "--encoder-attention-heads", "4", "--max-source-positions", "64",
                                "--norm-placement", placement, "--norm-type", kind)
    assert classifier.encoder.layers[0].residual_scale == (deepnorm_constants(2, 0)["encoder"][0]
                                                           if placement == "deepnorm" else 1.0)


def test_sandwich_refuses_normformers_attention_norm(lm_data):
    with pytest.raises(PowerNormConfigError, match="--scale-attn .* --norm-placement sandwich already has"):
        build_model(lm_data, "--task", "language_modeling", "--arch", "powernorm_transformer_lm",
                    "--tokens-per-sample", "32", *TINY_LM, "--norm-placement", "sandwich", "--scale-attn")


@pytest.mark.parametrize("kind", NORM_TYPES)
def test_every_kind_as_qk_norm_trains_a_step_or_is_refused_in_one_line(toy_data, kind):
    """Each registered kind: a per-token one normalises the heads' queries and keys (a training step's
    gradient reaches its parameters), the others are refused naming the allowed ones."""
    if kind not in QK_KINDS + ("none",):
        with pytest.raises(PowerNormConfigError, match=f"^--qk-norm {kind}: .* choose one of {', '.join(QK_KINDS)}$"):
            build(toy_data, "pre", "--qk-norm", kind)
        return
    model, task = build(toy_data, "pre", "--qk-norm", kind)
    batch = sample(task)
    model.train()
    model(**batch["net_input"])[0].float().logsumexp(-1).mean().backward()
    q = model.decoder.layers[0].self_attn.q_proj
    assert hasattr(q, "norm") == (kind != "none")
    if kind != "none" and list(q.norm.parameters()):
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in q.norm.parameters())


@pytest.mark.parametrize("placement", ["sandwich", "rezero"])
def test_a_decoder_layer_called_without_encoder_out_gives_its_feed_forward_its_own_norm_or_gate(toy_data, placement):
    """fairseq's decoder layer skips its encoder attention without encoder_out: the feed-forward still gets the
    feed-forward's output norm (sandwich) or gate (rezero), not the encoder attention's."""
    model, _ = build(toy_data, placement)
    layer = model.decoder.layers[0].double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if placement == "rezero":
            layer.rezero_gates.copy_(torch.tensor([0.5, -3.0, 2.0], dtype=torch.float64))
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)

    def ln(norm, h):
        return F.layer_norm(h, h.shape[-1:], norm.weight, norm.bias, norm.eps)

    def ff(h):
        return layer.fc2(F.relu(layer.fc1(h)))

    if placement == "sandwich":  # output norms 0, 1, 2: self-attention, encoder attention, feed-forward
        h = x + ln(layer.output_norms[0], attention(ln(layer.self_attn_layer_norm, x), pad, layer.self_attn))
        want = h + ln(layer.output_norms[2], ff(ln(layer.final_layer_norm, h)))
    else:
        h = x + layer.rezero_gates[0] * attention(x, pad, layer.self_attn)
        want = h + layer.rezero_gates[2] * ff(h)
    y, _, _ = layer(x, None, None, self_attn_padding_mask=pad)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["sandwich", "deepnorm", "rezero"])
def test_a_compiled_encoder_layer_matches_eager_at_lengths_that_vary(toy_data, placement):
    """torch.compile of an encoder layer with each placement that changes fairseq's residual, and QK-norm:
    eager's output and gradients over lengths 5 to 9, and back, in at most 2 graphs."""
    import copy

    from test_off_path import Counting

    torch._dynamo.reset()
    model, _ = build(toy_data, placement, "--qk-norm", "rmsnorm")
    eager = model.encoder.layers[0].train()
    with torch.no_grad():  # the gates and gains off their start
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    compiled = copy.deepcopy(eager)
    counting = Counting()
    step = torch.compile(compiled, backend=counting)
    g = torch.Generator().manual_seed(1)
    for length in (5, 6, 7, 8, 9, 6):
        x, dy = torch.randn(length, 3, 32, generator=g), torch.randn(length, 3, 32, generator=g)
        pad = torch.arange(length)[None, :] >= torch.randint(1, length + 1, (3,), generator=g)[:, None]
        outs = []
        for layer, call in ((eager, eager), (compiled, step)):
            xr = x.clone().requires_grad_(True)
            layer.zero_grad()
            y = call(xr, pad)
            y.backward(dy)
            outs.append([y.detach(), xr.grad] + [p.grad for p in layer.parameters()])
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert 1 <= counting.graphs <= 2, counting.graphs


def test_a_per_layer_list_has_one_spelling_and_refuses_what_is_not_a_layer():
    from powernorm_fairseq.norms.placement import LAYER_PLACEMENTS, per_layer

    kinds = per_layer(NORM_TYPES, "--encoder-layer-norms")
    assert kinds("ln,ln*2,bn") == kinds("ln*3,bn*1") == "ln*3,bn"
    for bad, message in [("ln,lnx", "'lnx' is not one of"), ("ln*0", "a whole number above 0"), ("ln*", "whole"),
                         ("bn*2.5", "whole")]:
        with pytest.raises(Exception, match=message):
            kinds(bad)
    with pytest.raises(Exception, match="'deepnorm' is not one of pre, post, sandwich, output"):
        per_layer(LAYER_PLACEMENTS, "--encoder-layer-placements")("pre,deepnorm")
