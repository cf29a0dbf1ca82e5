"""--report-to: the metrics.jsonl rows, live, in TensorBoard or Weights & Biases (rank 0 only).

Every row train.py appends to OUT/metrics.jsonl is also written here, at the row's own step: each
numeric value under its metrics.jsonl key (`eval/<task>/accuracy` included); `step` is the x-axis,
not a curve; a None (`kl_k1` without a reference) or a non-numeric value is skipped, never a NaN.

- tensorboard: event files in OUT itself, so `tensorboard --logdir runs` names each run after its
  folder; the flags as the text `config`. Values are stored as float32 (TensorBoard's scalars).
  A resume from the checkpoint of step N opens the same folder with purge_step N + 1: the steps a
  killed run logged after its checkpoint are dropped, as checkpoint.start_log drops them from
  metrics.jsonl, and the resumed run logs them again.
- wandb: one W&B run per run folder, named after it, the flags as its config, its id kept in
  OUT/wandb_id so a resume continues the same run (resume="allow"); files in OUT/wandb.
  WANDB_MODE=offline logs there without a network (`wandb sync` uploads later); the project is
  $WANDB_PROJECT or comedy-of-estimators. W&B does not purge. Online, the resumed run starts at the
  server's last step and wandb-core drops rows logged below it ("Tried to log to step N that is less
  than the current step M", wandb 0.31.0): the steps a killed run logged after its checkpoint keep
  the killed run's values (the resume recomputes them bit for bit; only the timings differ).
  Offline, each start's OUT/wandb/offline-run-* holds all its own rows.

Neither package is required: `problem` (flags.check_flags) names the install command, or the
offline mode when W&B has no credentials, before any model loads; `open` turns a wandb.init that
fails (no network) into the same one-line error, on every rank, before the first step.
"""
import netrc
import numbers
import os
from urllib.parse import urlsplit

from systems import runtime

CHOICES = ("none", "tensorboard", "wandb")
WANDB_PROJECT = "comedy-of-estimators"
OFFLINE_MODES = ("offline", "dryrun", "disabled")  # the WANDB_MODEs that need no W&B account
OFFLINE_HINT = "set WANDB_MODE=offline to log to OUT/wandb without a network (`wandb sync` later)"

_writer = None  # rank 0's open writer: {"log": log(scalars, step), "close": close()}


class CannotOpen(Exception):
    """A writer that cannot open, with the one-line reason."""


def problem(report_to):
    """Why --report-to `report_to` cannot work here, as a one-line message, or None."""
    if report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            return "--report-to tensorboard needs the tensorboard package: pip install tensorboard"
    elif report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            return "--report-to wandb needs the wandb package: pip install wandb"
        if (os.environ.get("WANDB_MODE", "").lower() not in OFFLINE_MODES
                and not has_wandb_credentials()):
            return f"--report-to wandb found no W&B API key: {OFFLINE_HINT}, or run `wandb login`"
    return None


def has_wandb_credentials():
    """Whether W&B has an API key to go online with: WANDB_API_KEY (or an identity token file), or
    the netrc entry `wandb login` writes for the server. Read without starting wandb's service."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import wandb

    servers = {os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url,
               "https://api.wandb.ai"}
    try:
        entries = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc"))
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(urlsplit(server).netloc) for server in servers)


def open(args, start_step, rank):
    """Open --report-to's writer on rank 0 (every rank calls this, and stops with rank 0 if it
    cannot open): returns `write` there, None on other ranks or with --report-to none.
    `start_step` is the step the run continues from (0 for a new run)."""
    global _writer
    close()
    writer, error = None, None
    if rank == 0 and args.report_to != "none":
        opener = open_tensorboard if args.report_to == "tensorboard" else open_wandb
        try:
            writer = opener(args, start_step)
        except CannotOpen as caught:
            error = str(caught)
    runtime.stop_if_any_rank(error, "train.py")
    _writer = writer
    return write if writer else None


def write(row):
    """Log a metrics.jsonl row at its step: its numbers, not None or anything non-numeric."""
    scalars = {key: float(value) for key, value in row.items()
               if key != "step" and isinstance(value, numbers.Real)}
    _writer["log"](scalars, row["step"])


def close():
    """Flush and close the writer `open` opened, if any."""
    global _writer
    if _writer:
        _writer["close"]()
    _writer = None


def run_config(args):
    """The flags, as checkpoint.start_log writes them to config.json."""
    return {key: str(value) if isinstance(value, os.PathLike) else value
            for key, value in vars(args).items()}


def open_tensorboard(args, start_step):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step: TensorBoard drops what earlier writers logged at steps >= start_step + 1
    writer = SummaryWriter(log_dir=str(args.out), purge_step=start_step + 1)
    flags = "\n".join(f"| --{key.replace('_', '-')} | {value} |"
                      for key, value in run_config(args).items())
    writer.add_text("config", "| flag | value |\n|---|---|\n" + flags, global_step=start_step)
    writer.flush()
    print(f"TensorBoard: event files in {args.out}; watch with `tensorboard --logdir "
          f"{args.out.parent}`")

    def log(scalars, step):
        for key, value in scalars.items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()  # a step takes seconds to minutes: show it at once, lose nothing to a kill

    return {"log": log, "close": writer.close}


def open_wandb(args, start_step):
    import wandb

    id_file = args.out / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
                         name=args.out.resolve().name, id=run_id, resume="allow",
                         dir=str(args.out.resolve()), config=run_config(args))
    except Exception as caught:  # no network, a bad key, a server error: wandb's own types vary
        reason = (str(caught).strip() or type(caught).__name__).splitlines()[0]
        raise CannotOpen(f"--report-to wandb: wandb.init failed ({reason}); {OFFLINE_HINT}")
    id_file.write_text(run.id + "\n")
    where = args.out / "wandb"
    resuming = f", resuming after step {start_step}" if start_step else ""
    upload = (f"; upload every part with `wandb sync {where}/offline-run-*`"
              if run.settings.mode == "offline" else "")
    print(f"W&B: run {run.id} ({run.settings.mode}{resuming}), files in {where}{upload}")

    def log(scalars, step):
        run.log(scalars, step=step)

    def close():
        run.finish()
        # finish only asks wandb's service to close the run's files; teardown waits until it has
        # (right after finish, 1 in 8 offline runs' .wandb files held only their header)
        wandb.teardown()

    return {"log": log, "close": close}
