"""Every change this plugin makes to fairseq's behaviour, listed in one place.

Importing ``powernorm_fairseq`` without fairseq changes nothing. Under
fairseq's ``--user-dir`` it registers the models and installs ``AT_IMPORT``
only, what acts before any model code could: ``fairseq-generate``,
``fairseq-interactive`` and ``fairseq-eval-lm`` read the checkpoint first
(and under torch >= 2.6 no fairseq checkpoint, of a stock model either,
loads without the first entry), and argparse refuses a flag value first.
These change what a failure prints, never what a run computes.

``WITH_THE_MODELS`` is installed by this plugin's models: by their
architectures (``models.options.powernorm_defaults``, which fairseq calls once
the flags are parsed, before the data and the save directory are touched)
and by ``build_model`` (every command that builds one, and each worker of a
distributed run). A stock model trained with ``--user-dir`` is trained
exactly as fairseq trains it.

``AT_START`` is installed before any of that, in every Python process of an
environment where the plugin is installed: ``powernorm_fairseq-archives.pth``
(site-packages) loads ``patches/archives.py`` alone at start-up, so that a
model archive is extracted safely whatever the process imports first
(fairseq's hub extracts before it imports a ``user_dir``). Importing the
plugin installs it too (a source checkout without the .pth).

Each entry names the test that fails without it.
"""

from ..common.checkpoints import allow_fairseq_checkpoints
from . import archives, checkpoints, compat, datafiles, diverged, errors, regularizers, savedir, shutdown
from .base import Patch, installs_once

__all__ = ["AT_START", "AT_IMPORT", "WITH_THE_MODELS", "Patch", "for_the_models", "install", "installs_once"]


AT_START = (
    Patch("safe archives",
          "a model archive (from_pretrained) holds files and folders only, each checked before anything is "
          "extracted into a folder of its own; the user's archive is never removed; in every process, whatever "
          "it imports first",
          archives.safe_archives,
          "test_loaders.py::test_the_guard_holds_in_a_fresh_interpreter_that_never_imports_the_plugin"),
)

AT_IMPORT = AT_START + (
    Patch("weights-only checkpoints",
          "torch >= 2.6 loads weights only, and fairseq's checkpoints hold an argparse.Namespace",
          allow_fairseq_checkpoints,
          "test_cli.py::test_train_then_generate"),
    Patch("weights-only loads in fairseq",
          "every torch.load of fairseq's code reads weights only, even under TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1: "
          "no file runs code (--ema-seed-model, the readers fairseq adds later)",
          checkpoints.weights_only_in_fairseq,
          "test_loaders.py::test_every_fairseq_loader_reads_weights_only_under_the_unsafe_variable"),
    Patch("unreadable checkpoints",
          "a truncated checkpoint, or one that holds code, is named in one line, not a 50-line traceback",
          checkpoints.name_unreadable_checkpoints,
          "test_faults.py::test_every_command_that_loads_a_checkpoint_refuses_code"),
    Patch("one-line errors",
          "this plugin's errors (and, with its models, fairseq's about its input) print one line",
          errors.install_excepthook,
          "test_cli.py::test_resuming_with_other_norms_fails_in_one_line"),
    Patch("over-long interactive lines",
          "fairseq-interactive skips a line longer than the model takes, saying so, and translates the rest",
          errors.skip_overlong_interactive_lines,
          "test_faults.py::test_an_overlong_line_is_skipped_by_fairseq_interactive_which_goes_on"),
    Patch("one-line usage errors",
          "a bad flag value prints argparse's error line without fairseq's 190-line usage block",
          errors.one_line_usage_errors,
          "test_cli.py::test_bad_flag_values_fail_in_one_line"),
)

WITH_THE_MODELS = (
    Patch("fairseq's input errors",
          "a data directory without dictionaries or an over-long sentence is one line",
          errors.name_fairseq_input_errors,
          "test_cli.py::test_data_directory_without_dictionary"),
    Patch("atomic copies",
          "checkpoint_last.pt and _best.pt are renamed into place, never left half-copied by a kill",
          checkpoints.atomic_checkpoint_copies,
          "test_tools.py::test_checkpoint_copies_are_atomic"),
    Patch("exact resume",
          "a resumed run trains on the same batches as an uninterrupted one",
          checkpoints.resume_with_the_same_batches,
          "test_cli.py::test_resume_is_bit_identical_to_an_uninterrupted_run"),
    Patch("failed saves",
          "a full disk ends the run in one line naming the file, with no partial file left",
          checkpoints.name_failed_saves,
          "test_faults.py::test_a_full_disk_ends_a_save_in_one_line_with_no_partial_file"),
    Patch("save-directory lock and debris",
          "one training per --save-dir; partial files removed and a broken checkpoint_last.pt replaced "
          "(for the plugin's models only: fairseq's own tests pass with it, test_stock_fairseq.py)",
          savedir.guard_training_runs,
          "test_faults.py::test_a_second_training_on_a_save_directory_stops_and_a_dead_ones_lock_does_not"),
    Patch("binarized data",
          "a truncated .bin/.idx is named in one line when opened",
          datafiles.check_binarized_data,
          "test_faults.py::test_a_bad_binarized_file_is_named_in_one_line"),
    Patch("shutdown",
          "loader threads and process groups end before interpreter exit, which otherwise aborts (status 134)",
          shutdown.install,
          "test_tools.py::test_process_groups_end_before_exit"),
    Patch("NumPy 2",
          "fairseq 0.12's datasets ask for np.compat.long, which NumPy 2 removed",
          compat.numpy_compat_long,
          "test_lm.py::test_train_and_evaluate_perplexity_through_the_cli"),
    Patch("NaN detector",
          "fairseq's NanDetector fails inside torch >= 2's module hooks (StopIteration), hiding why a run stopped",
          diverged.nan_detector_on_current_torch,
          "test_reproduce.py::test_a_diverged_run_says_so_with_its_update"),
    Patch("diverged updates",
          "a step whose gradients are NaN/Inf ends the run in one line naming the update",
          diverged.name_the_diverged_update,
          "test_reproduce.py::test_a_diverged_run_says_so_with_its_update"),
    Patch("norm regularizers",
          "rbn's penalty enters the loss of any criterion, weighted for the update's forwards and workers",
          regularizers.add_norm_regularizers,
          "test_patches.py::test_rbn_penalty_weighs_the_same_at_any_world_size_and_update_frequency"),
    Patch("bf16 without a TPU",
          "fairseq 0.12 makes --bf16 imply --tpu, and dies without torch_xla",
          compat.bf16_without_tpu,
          "test_precision.py::test_bf16_trains_through_fairseq_without_a_tpu"),
)


def install(patches) -> None:
    """Install ``patches`` (each installs once, however often it is called: :func:`installs_once`)."""
    for patch in patches:
        patch.install()


def for_the_models() -> None:
    """What this plugin's models need besides ``AT_IMPORT``."""
    install(WITH_THE_MODELS)
