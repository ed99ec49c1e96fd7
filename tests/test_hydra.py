"""fairseq-hydra-train with the plugin: configs/hydra/'s example configs train
a tiny model each, and the checkpoint's saved config and model carry the norms."""

import pytest
import torch

from support import ROOT, USER_DIR, cli

pytestmark = pytest.mark.slow

TINY = {"iwslt14-pn": ["encoder_layers=1", "decoder_layers=1", "encoder_embed_dim=32", "decoder_embed_dim=32",
                       "encoder_ffn_embed_dim=64", "decoder_ffn_embed_dim=64", "norm_placement=sandwich"],
        "lm-ptb-pn": ["decoder_embed_dim=32", "decoder_ffn_embed_dim=64", "decoder_attention_heads=4"]}


@pytest.mark.parametrize("config, data, norms", [
    ("iwslt14-pn", "toy_data", {"encoder": "PowerNorm", "decoder": "LayerNorm"}),
    ("lm-ptb-pn", "lm_data", {"decoder": "PowerNorm"}),
])
def test_the_example_configs_train_through_fairseq_hydra_train(config, data, norms, request, tmp_path):
    from fairseq import checkpoint_utils

    save = tmp_path / "ckpt"
    yaml = (ROOT / "configs" / "hydra" / f"{config}.yaml").read_text()
    cli("fairseq-hydra-train", "--config-dir", ROOT / "configs" / "hydra", "--config-name", config,
        f"task.data={request.getfixturevalue(data)}", f"common.user_dir={USER_DIR}", f"checkpoint.save_dir={save}",
        f"hydra.run.dir={tmp_path / 'hydra'}", "optimization.max_update=3", "dataset.max_tokens=600",
        *(("" if f"  {o.split('=')[0]}:" in yaml else "+") + f"model.{o}" for o in TINY[config]),
        *(["task.tokens_per_sample=32"] if config.startswith("lm") else []))
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    model_cfg = state["cfg"]["model"]
    assert model_cfg["norm_type"] == "pn"
    assert model_cfg.get("decoder_norm_type") == ("ln" if config.startswith("iwslt") else "pn")
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(save / "checkpoint_last.pt")])
    if config.startswith("iwslt"):  # a placement other than the config's, through hydra and the checkpoint
        assert model_cfg["norm_placement"] == "sandwich" and len(models[0].encoder.layers[0].output_norms) == 2
    for part, cls in norms.items():
        kinds = {type(m).__name__ for name, m in models[0].named_modules()
                 if name.startswith(part) and name.endswith(("_layer_norm", "layer_norm"))}
        assert kinds == {cls}, (part, kinds)


@pytest.mark.parametrize("override, message", [
    ("+model.pn_alpha_fwd=1.5", "--pn-alpha-fwd must be in (0, 1), got 1.5"),
    # hydra takes any key: a misspelling would train the default norm (pn) with exit status 0
    ("+model.norm_typ=bn", "model.norm_typ: not a setting of powernorm_transformer_iwslt_de_en "
                           "(did you mean model.norm_type?)"),
    ("model.norm_placement=rezero", "--norm-placement rezero has no norms in its layers (a residual gate that "
                                    "starts at 0 instead): pass --norm-type none, not ln, pn"),
])
def test_a_bad_value_or_key_in_a_hydra_config_is_refused_naming_it(toy_data, tmp_path, override, message):
    proc = cli("fairseq-hydra-train", "--config-dir", ROOT / "configs" / "hydra", "--config-name", "iwslt14-pn",
               f"task.data={toy_data}", f"common.user_dir={USER_DIR}", f"checkpoint.save_dir={tmp_path / 'ckpt'}",
               f"hydra.run.dir={tmp_path / 'hydra'}", "optimization.max_update=1", "dataset.max_tokens=600",
               "+model.encoder_layers=1", "+model.decoder_layers=1", override, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr.splitlines(), proc.stderr[-1000:]  # hydra's compact error: the line alone
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
