"""The ``quantnorm`` command line: parse, call the library, print. Nothing here computes.

Every error a user can fix becomes one line on stderr and exit code 2 (tracebacks with --debug).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import click

from . import __version__
from .data import BUILTIN_PYDOC, DataConfig
from .errors import QuantnormError
from .models import NORMS, PLACEMENTS, ModelConfig

DEFAULT_MODEL = ModelConfig()


def _default_train():
    from .train import TrainConfig

    return TrainConfig()


def training_options(func):
    """The flags that define a trained model (shared by ``train`` and ``evaluate``)."""
    t = _default_train()
    options = [
        click.option("--placement", type=click.Choice(list(PLACEMENTS)), required=True,
                     help="Where the norm sits: post, pre, peri, deepnorm (DeepNet) or residual (ResiDual)."),
        click.option("--norm", type=click.Choice(list(NORMS)), required=True,
                     help="Which norm: layer (LayerNorm) or rms (RMSNorm)."),
        click.option("--layers", type=int, default=DEFAULT_MODEL.n_layers, show_default=True, help="Number of blocks."),
        click.option("--d-model", type=int, default=DEFAULT_MODEL.d_model, show_default=True, help="Hidden size."),
        click.option("--heads", type=int, default=DEFAULT_MODEL.n_heads, show_default=True,
                     help="Attention heads (must divide --d-model)."),
        click.option("--context", type=int, default=DEFAULT_MODEL.context, show_default=True,
                     help="Context length in bytes; also the evaluation window."),
        click.option("--steps", type=int, default=t.steps, show_default=True, help="Training steps."),
        click.option("--batch-size", type=int, default=t.batch_size, show_default=True, help="Windows per step."),
        click.option("--lr", type=float, default=t.lr, show_default=True, help="Peak learning rate (AdamW)."),
        click.option("--warmup", type=int, default=None,
                     help=f"Linear warm-up steps before cosine decay (0 = none). "
                          f"[default: {t.warmup}, or steps/4 when training is shorter than {4 * t.warmup} steps]"),
        click.option("--seed", type=int, default=t.seed, show_default=True, help="Seed for weights and batches."),
        click.option("--corpus", type=str, default=BUILTIN_PYDOC, show_default=True,
                     help="Training text: a file, a directory of files, or builtin:pydoc (CPython's docs)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_run_config(placement, norm, layers, d_model, heads, context, steps, batch_size, lr, warmup, seed, corpus):
    from .train import RunConfig, TrainConfig

    if warmup is None:
        warmup = min(TrainConfig.warmup, max(steps, 0) // 4)
    return RunConfig(
        model=ModelConfig(placement=placement, norm=norm, n_layers=layers, d_model=d_model, n_heads=heads, context=context),
        train=TrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, seed=seed),
        data=DataConfig(corpus=corpus),
    )


def default_run_dir(run) -> Path:
    m, t = run.model, run.train
    return Path("runs") / f"{m.placement}-{m.norm}-L{m.n_layers}-d{m.d_model}-s{t.steps}-w{t.warmup}-seed{t.seed}"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="quantnorm")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """quantnorm: does a Transformer's normalization placement survive INT8 deployment?

    Train models that differ only in where the norm sits (post, pre, peri, deepnorm, residual)
    and which norm it is (layer, rms); export to ONNX; quantize to INT8; measure accuracy,
    latency and outliers; write a report; gate a CI deployment on the result.
    """
    ctx.obj = {"debug": debug}


@cli.command()
@training_options
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Run directory to write (default: runs/<placement>-<norm>-...).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(out, quiet, **flags):
    """Train one model and write its checkpoint, config and per-step log.

    Example: quantnorm train --placement pre --norm rms --steps 400
    """
    from .runs import check_out_dir
    from .train import train as run_training

    run = build_run_config(**flags)
    out = check_out_dir(out or default_run_dir(run))
    result = run_training(run, out, progress=not quiet)
    if result.diverged:
        click.echo(f"{out}: diverged at step {result.diverged_at} (recorded in train.json)")
    else:
        click.echo(f"{out}: {result.steps} steps, train loss {result.final_train_loss:.3f} nats, "
                   f"eval {result.eval_bits_per_byte:.3f} bits/byte, {result.tokens_per_s:,.0f} tokens/s, "
                   f"{result.wall_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: one-line errors and exit code 2 for anything a user can fix."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        result = cli.main(args=argv, prog_name="quantnorm", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        return 130
    except click.ClickException as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {exc.format_message()}", err=True)
        return 2
    except QuantnormError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
