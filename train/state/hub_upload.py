"""`hub: {model_id, strategy, private}`: a stage's model files pushed to the Hugging Face Hub with huggingface_hub, in
a background thread. Training never waits for an upload; a failed one is one warning line and the next save is
uploaded in its place; at the end of the run the final weights' upload is waited for. The token is huggingface_hub's
own (its login, or HF_TOKEN): nothing here reads or writes it."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from theworld.core import log
from theworld.model.stage_layout import CARD, CONFIG, EMA, PROMPT, WEIGHTS

_log = log.get(__name__)

MODEL_FILES = (WEIGHTS, EMA, CONFIG, CARD, PROMPT)  # a checkpoint's optimizer, RNG and state.json stay local


class HubUploader:
    """Main process only. `submit(folder)` stages the folder's model files (hard links, so a checkpoint rotated away
    by keep_last mid-upload is still whole) and returns at once; one upload runs at a time, and only the newest
    waiting folder is kept (it supersedes older ones)."""

    def __init__(self, model_id: str, private: bool, warn: Callable[[str], None], history: bool = False):
        self.model_id, self.private, self.warn, self.history = model_id, private, warn, history
        self.lock = threading.Lock()
        # (staged folder, commit message, folder in the repo); with history every save waits its turn, else only
        # the newest (it supersedes older ones)
        self.pending: list[tuple[Path, str, str | None]] = []
        self.thread: threading.Thread | None = None
        self.created = False
        self.uploaded: list[str] = []  # commit messages of the uploads that went through

    def submit(self, folder: str | Path, message: str, path_in_repo: str | None = None) -> None:
        """`path_in_repo`: the folder whole (optimizer, RNG and state.json too: resumable) under that folder of the
        repo, kept beside the earlier ones; None: its model files at the repo's top."""
        staged = _stage(Path(folder), whole=path_in_repo is not None)
        with self.lock:
            if not self.history:
                for old in self.pending:
                    shutil.rmtree(old[0], ignore_errors=True)
                self.pending = []
            self.pending.append((staged, message, path_in_repo))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._drain, name="hub-upload", daemon=True)
                self.thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the uploads under way; False when they are still running after `timeout` seconds."""
        thread = self.thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _drain(self) -> None:
        while True:
            with self.lock:
                if not self.pending:
                    return
                staged, message, path_in_repo = self.pending.pop(0)
            try:
                self._upload(staged, message, path_in_repo)
                self.uploaded.append(message)
            except Exception as e:  # noqa: BLE001 - any failure (network, auth, hub) is reported, never raised
                self.warn(
                    f"warning: hub upload to {self.model_id} failed ({message}): "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; the next save is "
                    "uploaded in its place"
                )
            finally:
                shutil.rmtree(staged, ignore_errors=True)

    def _upload(self, staged: Path, message: str, path_in_repo: str | None = None) -> None:
        from huggingface_hub import HfApi

        api = HfApi()
        if not self.created:
            api.create_repo(self.model_id, private=self.private, exist_ok=True)
            self.created = True
        where = {"path_in_repo": path_in_repo} if path_in_repo else {}
        api.upload_folder(repo_id=self.model_id, folder_path=str(staged), commit_message=message, **where)


def _stage(folder: Path, whole: bool = False) -> Path:
    staged = Path(tempfile.mkdtemp(prefix=".hub-", dir=folder.parent))
    for name in sorted(p.name for p in folder.iterdir() if p.is_file()) if whole else MODEL_FILES:
        src = folder / name
        if src.is_file():
            try:
                os.link(src, staged / name)
            except OSError:
                shutil.copy2(src, staged / name)
    return staged


def for_run(cfg, accelerator, warn: Callable[[str], None]) -> HubUploader | None:
    if cfg.hub.model_id is None or not accelerator.is_main_process:
        return None
    return HubUploader(cfg.hub.model_id, cfg.hub.private, warn, cfg.hub.history)


def finish(uploader: HubUploader | None, final: Path) -> None:
    """End of run: upload final/ and wait for it (the weights would otherwise never reach the hub)."""
    if uploader is None:
        return
    uploader.submit(final, "final")
    _log.info(f"uploading {final} to the hub as {uploader.model_id} ...")
    uploader.wait()
    if "final" in uploader.uploaded:
        _log.info(f"uploaded: https://huggingface.co/{uploader.model_id}")
    else:
        _log.info(f"upload it by hand: huggingface-cli upload {uploader.model_id} {final} .")
