"""Nothing silently different: a model rebuilt from a checkpoint (resume,
--finetune-from-model, --model-overrides, the hub, powernorm-average,
powernorm-analyze) computes what the checkpoint's model computed, or is
refused in one line naming the setting. Every setting the plugin registers is
classified (``models/settings.py``), found by walking the models' parsers."""

import argparse
import shutil
from dataclasses import fields

import pytest
import torch

from support import USER_DIR, cli, train_args
from test_faults import one_line_error
from powernorm_fairseq.common.errors import PowerNormConfigError
from powernorm_fairseq.models import settings
from powernorm_fairseq.models.options import FUNCTION, TRAINING, NormConfig, norm_fields

FIELDS = {f.name: f for f in fields(NormConfig) if "argparse" in f.metadata}


def plugin_models():
    """Every model class the plugin registers, with the fairseq model whose flags it extends."""
    from fairseq.models import MODEL_REGISTRY
    from fairseq.models.transformer import TransformerModel
    from fairseq.models.transformer_lm import TransformerLanguageModel

    parents = {"powernorm_transformer": TransformerModel, "powernorm_transformer_lm": TransformerLanguageModel,
               "powernorm_classifier": TransformerModel}  # (the classifier is the transformer's encoder)
    for name, cls in sorted(MODEL_REGISTRY.items()):
        if cls.__module__.startswith("powernorm_fairseq."):
            yield name, cls, parents.get(name)


def dests(add_args):
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return {a.dest for a in parser._actions}


@pytest.mark.fast
def test_every_setting_the_plugin_registers_is_classified():
    """The flags each plugin model adds to its fairseq parent's: each is a
    NormConfig field with a role, function or training; a flag added any other
    way fails here until it is classified."""
    models = list(plugin_models())
    missing = [name for name, _, parent in models if parent is None]
    assert missing == [], f"a model of the plugin without its fairseq parent here: {missing}"
    for name, cls, parent in models:
        added = dests(cls.add_args) - dests(parent.add_args)
        assert added, name
        unclassified = sorted(d for d in added if FIELDS.get(d) is None
                              or FIELDS[d].metadata.get("role") not in (FUNCTION, TRAINING))
        assert unclassified == [], f"{name}: settings with no role: {unclassified}"
    assert {f.name for f in norm_fields()} == set(FIELDS)


def base(**given):
    """A translation model's flags as its architecture fills them."""
    args = argparse.Namespace(**{n: f.default for n, f in FIELDS.items()}, encoder_attention_heads=4,
                              decoder_attention_heads=4, activation_fn="relu", no_scale_embedding=False,
                              no_token_positional_embeddings=False, cross_self_attention=False)
    vars(args).update(given)
    return args


def another(name, args):
    """A value of setting ``name`` other than the one ``args`` has (as the model uses it)."""
    f, value = FIELDS[name], getattr(args, name)
    options = f.metadata["argparse"]
    if name.endswith(("_self", "_cross", "_ff")) or name == "qk_norm":
        return "rmsnorm"
    if options.get("choices"):
        return next(c for c in options["choices"] if c != value)
    if options.get("action") in ("store_true", argparse.BooleanOptionalAction):
        return not (value if value is not None else name in ("layer_scale", "pn_group_scaling"))
    if name.endswith("_layer_norms"):
        return "rmsnorm*2"
    if name.endswith("_layer_placements"):
        return "post*2"
    if name in ("norm_groups", "mixln_post_layers"):
        return 2 if value is None else value + 1
    if name == "init":
        return "xavier-kaiming"
    return 0.5 if value is None else value * 2


@pytest.mark.fast
@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.metadata["role"] == FUNCTION])
def test_every_function_setting_tells_two_models_apart(name):
    """Changed alone, with a norm of a kind it is an option of in the model,
    each function setting changes what a rebuilt model is compared by."""
    kinds = FIELDS[name].metadata["kinds"]
    kind = ("pn" if "pn" in kinds else kinds[0]) if kinds else None
    given = dict(norm_type=kind, decoder_norm_type=kind) if kinds else {}
    if name == "rezero_gates":
        given.update(norm_placement="rezero", norm_type="none", decoder_norm_type="none")
    if name == "qk_norm_scope":
        given.update(qk_norm="rmsnorm")
    if name == "mixln_post_layers":
        given.update(norm_placement="mixln")
    before = base(**given)
    after = base(**{**given, name: another(name, before)})
    diff = settings.differences(settings.function_settings(before), settings.function_settings(after))
    assert diff, name
    assert diff[0][0] in (name, "layer_scale")  # the pn-only spelling of the layer scale is compared as it


@pytest.mark.fast
@pytest.mark.parametrize("name", settings.FAIRSEQ_FUNCTION)
def test_fairseqs_parameter_free_settings_tell_two_models_apart(name):
    """fairseq's own settings that change the function and no parameter's shape are compared too."""
    value = getattr(base(), name)
    changed = "gelu" if value == "relu" else not value if isinstance(value, bool) else value * 2
    assert settings.differences(settings.function_settings(base()), settings.function_settings(base(**{name: changed})))


@pytest.mark.fast
@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.metadata["role"] == TRAINING])
def test_training_settings_and_equal_spellings_leave_the_function_alone(name):
    args = base()
    assert settings.function_settings(base(**{name: another(name, args)})) == settings.function_settings(args)
    # a sublayer given its side's kind, the default layer scale given, none as QK-norm: the same model
    same = base(encoder_norm_self="pn", decoder_norm_ff="ln", layer_scale=True, qk_norm="none")
    assert settings.function_settings(same) == settings.function_settings(args)
    # an option of a kind the model does not have is no difference, nor Mix-LN's split without Mix-LN
    assert settings.function_settings(base(adanorm_scale=3.0)) == settings.function_settings(args)
    assert settings.function_settings(base(mixln_post_layers=3)) == settings.function_settings(args)


@pytest.fixture(scope="module")
def pn_checkpoint(trained, tmp_path_factory):
    """A pre-norm pn model's checkpoint (no QK-norm), and the same weights saved as a model with
    ``--qk-norm layernorm-simple``, a parameter-free kind: the same keys, another function."""
    root = tmp_path_factory.mktemp("settings")
    plain = root / "plain.pt"
    shutil.copy(trained("pn") / "checkpoint_last.pt", plain)
    state = torch.load(plain, weights_only=True)
    state["cfg"]["model"].qk_norm = "layernorm-simple"
    torch.save(state, root / "qk.pt")
    return plain, root / "qk.pt"


@pytest.mark.slow
@pytest.mark.parametrize("flags, setting", [
    (["--qk-norm", "layernorm-simple"], "--qk-norm: the checkpoint has none, this asks layernorm-simple"),
    (["--no-layer-scale"], "--layer-scale: the checkpoint has pn on, this asks pn off"),
    (["--norm-placement", "post"], "--norm-placement: the checkpoint has pre, this asks post"),
])
@pytest.mark.parametrize("how", ["resume", "finetune"])
def test_training_on_from_a_checkpoint_of_another_model_is_refused_in_one_line(toy_data, trained, tmp_path, how,
                                                                               flags, setting):
    last = trained("pn") / "checkpoint_last.pt"
    if how == "resume":
        shutil.copy(last, tmp_path)
        extra = []
    else:
        extra = ["--finetune-from-model", last]
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-type", "pn", *flags, *extra, max_update=44),
               check=False)
    one_line_error(proc, "checkpoint_last.pt", "fairseq-train")
    assert setting in proc.stderr and "--allow-setting-changes" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_deliberate_fine_tune_and_a_training_setting_change_are_logged(toy_data, trained, tmp_path):
    last = trained("pn") / "checkpoint_last.pt"
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "ft", "--norm-type", "pn", "--qk-norm",
                                            "layernorm-simple", "--finetune-from-model", last,
                                            "--allow-setting-changes", max_update=2))
    assert "--qk-norm: the checkpoint has none, this asks layernorm-simple (--allow-setting-changes)" in proc.stdout
    saved = torch.load(tmp_path / "ft" / "checkpoint_last.pt", weights_only=True)
    assert saved["cfg"]["model"].qk_norm == "layernorm-simple"
    shutil.copytree(trained("pn"), tmp_path / "resume", ignore=shutil.ignore_patterns("*.lock", "*.log"))
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "resume", "--norm-type", "pn", "--pn-alpha-fwd",
                                            "0.8", max_update=42))
    assert "--pn-alpha-fwd: the checkpoint has 0.9, this asks 0.8: a training setting, changed from here on" \
        in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("override, setting", [
    ("{'qk_norm': 'none'}", "--qk-norm: the checkpoint has layernorm-simple, this asks none"),
    ("{'norm_placement': 'post'}", "--norm-placement: the checkpoint has pre, this asks post"),
    ("{'encoder_attention_heads': 8}", "--encoder-attention-heads: the checkpoint has 4, this asks 8"),
])
def test_generate_refuses_an_override_that_builds_another_model(toy_data, pn_checkpoint, override, setting):
    _, qk = pn_checkpoint
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", qk, "--beam", "1", "--cpu",
               "--max-sentences", "8", "--model-overrides", override, check=False, timeout=300)
    one_line_error(proc, qk, "fairseq-generate")
    assert setting in proc.stderr


@pytest.mark.slow
def test_the_hub_and_average_refuse_another_model(toy_data, pn_checkpoint, tmp_path):
    from fairseq.models.transformer import TransformerModel

    plain, qk = pn_checkpoint
    folder = tmp_path / "hub"
    folder.mkdir()
    shutil.copy(qk, folder / "model.pt")
    with pytest.raises(PowerNormConfigError, match="--qk-norm: the checkpoint has layernorm-simple, this asks none"):
        TransformerModel.from_pretrained(str(folder), checkpoint_file="model.pt", data_name_or_path=str(toy_data),
                                         qk_norm="none")
    hub = TransformerModel.from_pretrained(str(folder), checkpoint_file="model.pt", data_name_or_path=str(toy_data),
                                           pn_alpha_fwd=0.5)  # a training setting: the same model
    attention = hub.models[0].encoder.layers[0].self_attn
    assert type(attention.q_proj).__name__ == "HeadNormProjection"
    proc = cli("powernorm-average", "--inputs", plain, qk, "--output", tmp_path / "avg.pt", check=False)
    one_line_error(proc, qk, "powernorm-average")
    assert "qk_norm='layernorm-simple' (not 'none')" in proc.stderr and not (tmp_path / "avg.pt").exists()


@pytest.mark.slow
def test_fifos_and_directories_given_as_checkpoints_are_refused_in_one_line(toy_data, trained, tmp_path):
    """Every reader of a user's checkpoint checks it is a regular file (common.files.check_regular_file):
    a FIFO would hold the command for ever."""
    import os

    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    said = "not a regular file"
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", fifo, "--cpu", check=False,
               timeout=120)
    one_line_error(proc, f"{fifo}: {said}", "fairseq-generate")
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", tmp_path, "--cpu", check=False,
               timeout=120)
    one_line_error(proc, f"{tmp_path}: is a directory, not a checkpoint", "fairseq-generate")
    proc = cli("powernorm-score", fifo, "--bleu", "iwslt14", check=False, timeout=60)
    one_line_error(proc, f"{fifo}: {said}", "powernorm-score")
    gen = tmp_path / "gen.txt"
    gen.write_text("T-0\thouse\nH-0\t-0.1\thouse\n")
    proc = cli("powernorm-score", gen, "--bleu", "iwslt14", "--checkpoint", fifo, check=False, timeout=60)
    one_line_error(proc, f"{fifo}: {said}", "powernorm-score")
    proc = cli("powernorm-analyze", "--ablation", fifo, "--out", tmp_path / "figures", check=False, timeout=60)
    one_line_error(proc, f"{fifo}: {said}", "powernorm-analyze")
    runs = tmp_path / "runs"
    runs.mkdir()
    for epoch in (1, 2):
        shutil.copy(trained("pn") / "checkpoint_last.pt", runs / f"checkpoint{epoch}.pt")
    os.mkfifo(runs / "checkpoint9.pt")
    proc = cli("powernorm-average", "--inputs", runs, "--num-epoch-checkpoints", "2", "--output",
               tmp_path / "avg.pt", check=False, timeout=60)
    one_line_error(proc, f"checkpoint9.pt: {said}", "powernorm-average")
    save = tmp_path / "resume"
    save.mkdir()
    os.mkfifo(save / "checkpoint_last.pt")
    proc = cli("fairseq-train", *train_args(toy_data, save, max_update=2), check=False, timeout=120)
    one_line_error(proc, f"checkpoint_last.pt: {said}", "fairseq-train")


@pytest.mark.slow
def test_a_unit_offset_model_trains_generates_and_is_told_apart(toy_data, trained, tmp_path):
    """--norm-unit-offset through fairseq: its checkpoint records the setting and holds gains stored as
    their offset from 1 (trained from 0); fairseq-generate translates with it; an override, the hub and
    powernorm-average refuse a model without it."""
    from fairseq.models.transformer import TransformerModel

    last = trained("bn", "--norm-unit-offset") / "checkpoint_last.pt"
    state = torch.load(last, weights_only=False)
    assert state["cfg"]["model"].norm_unit_offset is True
    gains = {k: v for k, v in state["model"].items() if k.endswith("layer_norm.weight")}
    assert gains and all(0 < float(v.abs().max()) < 0.5 for v in gains.values()), gains  # moved from 0, not 1
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", last, "--beam", "1", "--cpu",
               "--max-sentences", "8", timeout=300)
    assert sum(line.startswith("H-") for line in proc.stdout.splitlines()) > 0
    proc = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", last, "--beam", "1", "--cpu",
               "--max-sentences", "8", "--model-overrides", "{'norm_unit_offset': False}", check=False, timeout=300)
    one_line_error(proc, last, "fairseq-generate")
    assert "--norm-unit-offset: the checkpoint has True, this asks False" in proc.stderr
    folder = tmp_path / "hub"
    folder.mkdir()
    shutil.copy(last, folder / "model.pt")
    with pytest.raises(PowerNormConfigError, match="--norm-unit-offset: the checkpoint has True, this asks False"):
        TransformerModel.from_pretrained(str(folder), checkpoint_file="model.pt", data_name_or_path=str(toy_data),
                                         norm_unit_offset=False)
    state["cfg"]["model"].norm_unit_offset = False  # the same weights, read as gains without the offset
    torch.save(state, tmp_path / "plain.pt")
    proc = cli("powernorm-average", "--inputs", tmp_path / "plain.pt", last, "--output", tmp_path / "avg.pt",
               check=False)
    one_line_error(proc, last, "powernorm-average")
    assert "norm_unit_offset=True (not False)" in proc.stderr and not (tmp_path / "avg.pt").exists()
