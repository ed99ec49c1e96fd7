"""The plugin from Python: the README's own-model example, registration in
either import order, and loading a trained model through fairseq's hub
interface and ``load_model_ensemble_and_task``."""

import re

import pytest
import torch

from support import ROOT, USER_DIR, cli

pytestmark = pytest.mark.slow


def readme_block(marker):
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    return next(b for b in blocks if marker in b)


@pytest.mark.fast
def test_the_readme_example_runs_and_its_eval_mode_is_independent_of_the_batch():
    scope = {}
    exec(compile(readme_block("class Block"), "README.md", "exec"), scope)
    block, x, mask, y = scope["block"], scope["x"], scope["mask"], scope["y"]
    assert not block.training and y.shape == x.shape
    assert block.norm1.num_steps.item() == 1  # the training step counted; eval counted nothing
    alone = block(x[1:], mask[1:])  # in eval mode a sentence's output does not depend on its batch
    torch.testing.assert_close(alone[0, :3], y[1, :3])


@pytest.mark.parametrize("order", ["powernorm_fairseq, fairseq", "fairseq, powernorm_fairseq"])
def test_importing_the_plugin_registers_the_models_in_either_order(order):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            + "".join(f"import {name}\n" for name in order.split(", "))
            + "from fairseq.models import ARCH_MODEL_REGISTRY as A, MODEL_REGISTRY as M\n"
              "assert 'powernorm_transformer_iwslt_de_en' in A and 'powernorm_transformer_lm' in M, sorted(M)\n")
    cli("python", "-c", code, cwd="/")  # a process that has imported torch alone


def test_the_hub_interface_translates_in_eval_mode(trained, toy_data):
    from fairseq.models.transformer import TransformerModel

    hub = TransformerModel.from_pretrained(str(trained("pn")), checkpoint_file="checkpoint_last.pt",
                                           data_name_or_path=str(toy_data), user_dir=USER_DIR)
    assert not any(m.training for m in hub.models)
    out = hub.translate("haus baum katze")
    assert isinstance(out, str) and out.split()


def test_load_model_ensemble_and_task_gives_training_mode_until_eval(trained, toy_data):
    """As the README says: fairseq's loader leaves training mode on, in which PN
    normalises with each batch's statistics; after .eval() a sentence's
    output is the same alone or beside another."""
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(trained("bn", "--norm-unit-offset") / "checkpoint_last.pt")], arg_overrides={"data": str(toy_data)})
    model = models[0]
    assert model.training
    src = task.source_dictionary
    a = src.encode_line("haus baum katze", add_if_not_exist=False).long()[None]
    b = src.encode_line("auto buch tisch stuhl fenster", add_if_not_exist=False).long()[None, :4]

    def encode(tokens):
        with torch.no_grad():
            return model.encoder(tokens, src_lengths=tokens.ne(src.pad()).sum(1))["encoder_out"][0][:, 0]

    pair = torch.cat([a, b])
    assert not torch.allclose(encode(a), encode(pair), atol=1e-6)  # training mode: batch statistics
    model.eval()
    torch.testing.assert_close(encode(a), encode(pair))
