"""Code completion for editor clients: the root ``complete`` file (ollie(5), COMPLETION).

Why in the daemon. A completion is a model request, and model requests need the keys,
which live only in the daemon's settings (the environment or the config ``env`` file),
never in the tree. So the request runs here, on the daemon's backend pool, and a client
needs nothing but file I/O: ``u/complete`` is a small sh script any editor can run.

The exchange, on one open handle (the Plan 9 way): the client writes the request, in as
many write(2)s as it likes, then reads; the first read asks the model and waits for the
answer, which that read and the next ones return (from their offset, or from the end of
the request, as a control file's answer). A handle carries one request.

The request::

    backend=NAME        the backend; default OLLIE_COMPLETE_BACKEND, else OLLIE_BACKEND
    model=NAME          the model; default OLLIE_COMPLETE_MODEL (for that backend), else
                        the backend's default model
    file=NAME           the file's name, a hint of its language (optional)
    timeout=SECONDS     how long the read may wait; default OLLIE_COMPLETE_TIMEOUT, else 30
    max_tokens=N        at most N tokens to insert (1 to 4096; default 256)
    suffix=BYTES        how many bytes at the end of the body are the text after the cursor
    <an empty line>
    BODY                the text before the cursor, then the suffix's BYTES

Every header line is optional, and an empty value means the default (as in ``s/new``);
the empty line is not. The header is checked at the write that completes it, so a shell
sees a bad key refused (EINVAL) where it writes it; the body is checked at the read.

Errors of the read: EINVAL (a request without its empty line, a suffix longer than the
body, text that is not UTF-8), ETIMEDOUT (no answer in time), EREMOTEIO (the provider
failed: its words are the reason), EINTR (the reader was interrupted; the request is
cancelled when the handle is closed). Each reason goes to the root ``err``.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from olliefs.caller import Caller
from olliefs.errors import Interrupted, InvalidRequest, OllieError

if TYPE_CHECKING:  # the backends are imported at the first completion, not at mount
    from olliefs.backend.base import ProviderBackend
    from olliefs.backend.fim import Request
    from olliefs.backend.pool import Pool

log = logging.getLogger(__name__)

HEAD_MAX = 4096  # bytes of header before its empty line
DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 600.0
DEFAULT_TOKENS = 256
MAX_TOKENS = 4096
KEYS = ("backend", "model", "file", "timeout", "max_tokens", "suffix")


class TimedOut(OllieError):
    errno = errno.ETIMEDOUT


class ProviderFailed(OllieError):
    """The provider answered with an error, garbage, or not at all (network)."""

    errno = errno.EREMOTEIO


@dataclass(frozen=True)
class Head:
    backend: str = ""
    model: str = ""
    file: str = ""
    timeout: float | None = None
    max_tokens: int = DEFAULT_TOKENS
    suffix: int = 0


def _number(key: str, value: str, low: float, high: float) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not low <= number <= high:  # also refuses nan
        raise InvalidRequest(f"complete: {key}={value}: not a number from {low:g} to {high:g}")
    return number


def parse_head(text: str, backends: list[str]) -> Head:
    """The header lines (without the empty line that ends them)."""
    values: dict[str, str] = {}
    for line in text.split("\n") if text else ():
        key, sep, value = line.partition("=")
        if not sep:
            raise InvalidRequest(f"complete: {line!r}: not key=value")
        if key not in KEYS:
            raise InvalidRequest(f"complete: unknown key {key!r} (keys: {' '.join(KEYS)})")
        if key in values:
            raise InvalidRequest(f"complete: {key} given twice")
        if any((c < " " and c != "\t") or c == "\x7f" for c in value):
            raise InvalidRequest(f"complete: {key}: a control character in the value")
        values[key] = value
    given = {k: v.strip() if k != "file" else v for k, v in values.items() if v.strip()}
    backend = given.get("backend", "")
    if backend and backend not in backends:
        raise InvalidRequest(f"complete: unknown backend {backend} (known: {' '.join(backends)})")
    timeout = given.get("timeout")
    tokens = given.get("max_tokens")
    suffix = given.get("suffix", "0")
    if not suffix.isdigit():
        raise InvalidRequest(f"complete: suffix={suffix}: not a number of bytes")
    return Head(
        backend=backend,
        model=given.get("model", ""),
        file=given.get("file", ""),
        timeout=_number("timeout", timeout, 0.001, MAX_TIMEOUT) if timeout else None,
        max_tokens=int(_number("max_tokens", tokens, 1, MAX_TOKENS)) if tokens else DEFAULT_TOKENS,
        suffix=int(suffix),
    )


def split(data: bytes) -> tuple[bytes, bytes] | None:
    """(header, body) of a request, or None while its empty line has not come."""
    end = data.find(b"\n\n", 0, HEAD_MAX + 2)
    if data.startswith(b"\n"):
        return b"", data[1:]
    if end < 0:
        return None
    return data[:end], data[end + 2 :]


class Asked:
    """One request on its way: what a reader waits on (``nodes.Pending``)."""

    def __init__(self) -> None:
        self.done = False
        self._finished = trio.Event()
        self._answer = ""
        self._error: OllieError | None = None
        self.scope = trio.CancelScope()

    async def wait(self) -> None:
        await self._finished.wait()

    def result(self) -> str:
        if self._error is not None:
            raise self._error
        return self._answer

    def cancel(self) -> None:
        self.scope.cancel()

    def finish(self, answer: str = "", error: OllieError | None = None) -> None:
        self._answer, self._error = answer, error
        self.done = True
        self._finished.set()


class Completer:
    """Runs completions on the daemon's backends; one per daemon."""

    def __init__(
        self,
        pool: Callable[[], Pool],
        settings: Mapping[str, str],
        nursery: trio.Nursery,
        refused: Callable[[str], None],
    ) -> None:
        self._pool = pool
        self._nursery = nursery
        self._refused = refused
        self._backend = (
            settings.get("OLLIE_COMPLETE_BACKEND") or settings.get("OLLIE_BACKEND") or "openai"
        ).strip()
        self._model = settings.get("OLLIE_COMPLETE_MODEL", "").strip()
        raw = settings.get("OLLIE_COMPLETE_TIMEOUT", "").strip()
        try:
            self._timeout = _number("OLLIE_COMPLETE_TIMEOUT", raw, 0.001, MAX_TIMEOUT)
        except InvalidRequest as err:
            if raw:
                log.warning("%s; using %g s", err, DEFAULT_TIMEOUT)
            self._timeout = DEFAULT_TIMEOUT
        # (backend, model) pairs whose server or model has no fill in the middle: they get
        # the chat request at once (remembered while the daemon runs).
        self._chat_only: set[tuple[str, str]] = set()

    def _refuse(self, err: OllieError) -> OllieError:
        self._refused(str(err))
        return err

    def check(self, data: bytes) -> bool:
        """Check what a handle was written so far; True once nothing more can be checked
        before the read (the header is complete and valid)."""
        parts = split(data)
        if parts is None:
            if len(data) > HEAD_MAX:
                raise self._refuse(
                    InvalidRequest(f"complete: no empty line after {HEAD_MAX} bytes of header")
                )
            return False
        self._head(parts[0])
        return True

    def _head(self, raw: bytes) -> Head:
        try:
            return parse_head(raw.decode(), self._pool().names())
        except UnicodeDecodeError:
            raise self._refuse(InvalidRequest("complete: the header is not UTF-8")) from None
        except InvalidRequest as err:
            raise self._refuse(err) from None

    def ask(self, data: bytes, caller: Caller) -> Asked:
        """Start the request written on a handle; the reader waits on what this returns."""
        parts = split(data)
        if parts is None:
            raise self._refuse(InvalidRequest("complete: no empty line after the header"))
        head = self._head(parts[0])
        body = parts[1]
        if head.suffix > len(body):
            raise self._refuse(
                InvalidRequest(f"complete: suffix={head.suffix} but the body has {len(body)} bytes")
            )
        cut = len(body) - head.suffix
        try:
            prefix, suffix = body[:cut].decode(), body[cut:].decode()
        except UnicodeDecodeError:
            raise self._refuse(
                InvalidRequest("complete: the text is not UTF-8 (or suffix= cuts a character)")
            ) from None
        backend = head.backend or self._backend
        pool = self._pool()
        try:
            model = head.model or (self._model if backend == self._backend else "")
            model = model or pool.default_model(backend)
            provider = pool.get(backend)
        except ValueError as err:
            raise self._refuse(InvalidRequest(f"complete: {err}")) from None
        from olliefs.backend import fim

        request = fim.Request(prefix, suffix, head.file, head.max_tokens)
        asked = Asked()
        timeout = head.timeout or self._timeout
        self._nursery.start_soon(self._run, asked, provider, model, request, timeout)
        return asked

    async def _run(
        self,
        asked: Asked,
        backend: ProviderBackend,
        model: str,
        request: Request,
        timeout: float,
    ) -> None:
        from olliefs.backend import fim
        from olliefs.backend.base import BackendError

        where = f"{backend.name} (model {model})"
        answer: str | None = None
        error: OllieError | None = None
        try:
            with asked.scope:
                try:
                    with trio.fail_after(timeout):
                        answer = await fim.complete(backend, model, request, self._chat_only)
                except trio.TooSlowError:
                    error = TimedOut(f"complete: no answer from {where} within {timeout:g} s")
                except BackendError as err:
                    error = ProviderFailed(f"complete: {err}")
                except Exception:  # a bug here must not end the daemon's nursery
                    log.exception("completion by %s failed", where)
                    error = ProviderFailed(f"complete: {where}: internal error (see the log)")
            if error is not None and not asked.scope.cancelled_caught:
                self._refused(str(error))
        finally:  # also when the daemon stops: no reader waits for ever
            if answer is None and error is None:  # closed by its reader, or shutdown
                error = Interrupted("complete: cancelled")
            asked.finish(answer or "", error)
