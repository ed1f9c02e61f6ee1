"""What the runtimes' command lines share: token ids as an argument, and generated text
streamed as tokens arrive."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from runplan.arguments import positive_int
from runplan.gguf_error import GgufError
from runplan.gguf_header import GgufHeader
from runplan.models import resolve_model
from runtime_core.own_files import open_own_file
from runtime_core.tokenizer import Tokenizer, clean_up_spaces


def token_ids(text: str) -> list[int]:
    """An ``argparse`` type: ``1,2,3`` as a list of non-negative ids."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad token ids {text!r}: write 1,2,3") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("token ids are non-negative integers, at least one")
    return ids


def writable_file(text: str) -> Path:
    """An ``argparse`` type: a file this process can create or overwrite, checked when
    the command line is read, so that a run never ends in a failed write. Leaves no
    file behind where there was none. A file of this user's or a device only
    (``own_files``): another user's link, FIFO or file planted at a name in ``/tmp``
    was written through, or hung the run."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a directory")
    existed = os.path.lexists(path)
    try:
        os.close(open_own_file(path, "the trace", append=True, devices=True))
    except OSError as exc:  # FileRefused's names what is there
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not existed:
        path.unlink()
    return path


def shown_figures(figures: Mapping[str, object]) -> dict[str, object]:
    """A run's figures as a summary line shows them: ``-`` for one there is none of (a
    run of one token has no decode rate), never Python's ``None``."""
    return {k: "-" if v is None else v for k, v in figures.items()}


class IncrementalText:
    """The text of generated tokens, piece by piece as they arrive: ``push(token)``
    returns the new part of the decoded text. The end of the text is held back while it
    may still change: an incomplete UTF-8 sequence (U+FFFD), trailing whitespace, which
    a detokenizer that cleans up spaces may drop once punctuation follows, and there a
    space before an apostrophe at the end (``held``: what is held back, as the text
    stands now). Such a vocabulary's clean-up is applied to the text once its trailing
    whitespace is cut: cleaned up with it, ``"' '"`` showed ``"'"`` and ``"' '?"``
    (``"''?"``) then no longer began with what was shown.
    ``finish(text)`` returns what is left of the final ``text`` (``None`` when a
    character already returned changed after all). ``continues``: the text goes on from
    a prompt (a server's answer), so its first token keeps the space a vocabulary with a
    space prefix puts before it (``Tokenizer.decode``'s ``continues``, which the final
    text is decoded with too); else it begins a text, as the command line prints it."""

    def __init__(self, tokenizer: Tokenizer, *, continues: bool = False) -> None:
        self.tokenizer = tokenizer
        self.continues = continues
        self.ids: list[int] = []
        self.shown = ""
        self.held = ""
        #: characters of the decoded text so far, an incomplete UTF-8 sequence at its end
        #: left out (where the next token's text begins: a completion's ``text_offset``)
        self.chars = 0
        # The tokens' bytes before any clean-up, and a firm part of them, whose text
        # (decoded and cleaned up) is the start of the text of all the bytes, whatever
        # follows (``_firm_end``): a token decodes only the bytes after it (decoding
        # every token at each one took 7.6 s for 4000).
        self._bytes = bytearray()
        self._firm = 0
        self._firm_text = ""

    def push(self, token_id: int) -> str:
        tok = self.tokenizer
        # the first token's bytes as decode gives them (a space prefix dropped), unless
        # the text continues a prompt: then each token's bytes as they are
        self._bytes += tok.decode_bytes([token_id], clean_up=False) if not (
            self.ids or self.continues
        ) else tok.token_bytes(token_id)  # fmt: skip
        self.ids.append(token_id)
        end = _firm_end(self._bytes, self._firm)
        if end > self._firm:
            raw = self._bytes[self._firm : end].decode("utf-8", "replace")
            self._firm_text += clean_up_spaces(raw) if tok.vocab.clean_spaces else raw
            self._firm = end
        # What comes after the firm part begins with a character none of the cuts at
        # the end reach past (``_firm_end``): they are made to it alone.
        raw = self._bytes[self._firm :].decode("utf-8", "replace").rstrip("\ufffd")
        if tok.vocab.clean_spaces:
            full = self._firm_text + clean_up_spaces(raw)
            text = self._firm_text + _before_open_apostrophe(clean_up_spaces(raw.rstrip()))
        else:
            full = self._firm_text + raw
            text = full.rstrip()
        self.chars = len(full)
        new = ""
        if text.startswith(self.shown) and len(text) > len(self.shown):
            new, self.shown = text[len(self.shown) :], text
        self.held = full[len(text) :] if text == self.shown and full.startswith(text) else ""
        return new

    def finish(self, text: str) -> str | None:
        if not text.startswith(self.shown):
            return None
        rest, self.shown = text[len(self.shown) :], text
        return rest


#: Bytes no firm end is next to: those the clean-up of spaces looks at (a space, an
#: apostrophe), and whitespace, which the stream cuts from the end of the text.
_LOOSE = frozenset(b" '\t\n\v\f\r\x1c\x1d\x1e\x1f")


def _firm_end(data: bytearray, start: int) -> int:
    """The last place ``p`` in ``data`` past ``start`` where the text of ``data[:p]``
    is final: a character (UTF-8) ends there and another begins, neither whitespace,
    and none of the four bytes before it nor the one after is a space or an apostrophe,
    so that decoding, the clean-up of spaces (ASCII's; its rules reach two bytes across
    a place at most) and the stream's cuts at the end (whitespace, an open apostrophe)
    all treat what comes before and after it apart; ``start`` where there is none."""
    for p in range(len(data) - 1, start + 4, -1):
        a, b = data[p - 1], data[p]
        if 0x80 <= b < 0xC0 or a in _LOOSE or b in _LOOSE:
            continue  # within a character, or beside whitespace
        near = data[p - 4 : p]
        if 0x20 in near or 0x27 in near:
            continue
        if (a < 0x80 and b < 0x80) or _apart(data, p):
            return p
    return start


def _apart(data: bytearray, p: int) -> bool:
    """Whether whole characters end at ``p`` and begin there (strict UTF-8, the one
    before beginning within the four bytes before ``p``), neither of them whitespace."""
    for q in range(p - 1, max(p - 5, -1), -1):
        if not 0x80 <= data[q] < 0xC0:  # the last character's first byte
            break
    else:
        return False
    try:
        before = bytes(data[q:p]).decode()
        after = bytes(data[p : p + 4]).decode(errors="ignore")[:1]
    except UnicodeDecodeError:
        return False
    return len(before) == 1 and after != "" and not before.isspace() and not after.isspace()


def _before_open_apostrophe(text: str) -> str:
    """``text`` without a space and apostrophe at its end (``" '"``, ``" 'r"``), and
    without the whitespace before them, whose space the clean-up of a vocabulary that
    cleans up spaces drops once a space, ``s``, ``m``, ``re`` or ``ve`` follows
    (``tokenizer._clean_spaces``): shown, that space could not be taken back ("rock '"
    then "rock'n'roll" left the stream at "rock '"). Cut again while the end so left
    is one too (``" ' '"``)."""
    while True:
        text = text.rstrip()
        at = text.rfind(" '")
        if at < 0 or at < len(text) - 3:
            return text
        text = text[:at]


class TextStream:
    """Prints generated text as tokens arrive (``IncrementalText``). Written to standard
    error (``--json``: the text beside the object that standard output carries), it
    stops writing once that stream's reader went away (``BrokenPipeError``), and the
    run goes on: the reader gone was not standard output's, whose object is still owed
    (it ended the command, 141, the run cancelled and no object printed)."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO) -> None:
        self.text = IncrementalText(tokenizer)
        self.out = out
        self._reader_gone = False

    def _write(self, text: str) -> None:
        if self._reader_gone:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError:
            if self.out is not sys.stderr:
                raise  # standard output's reader: the command ends (141)
            self._reader_gone = True

    @property
    def ids(self) -> list[int]:
        """The tokens printed so far."""
        return self.text.ids

    def __call__(self, token_id: int) -> None:
        new = self.text.push(token_id)
        if new:
            self._write(new)

    def finish(self, text: str) -> None:
        """Write the rest of the final ``text`` and a newline."""
        rest = self.text.finish(text)
        if rest is not None:
            self._write(rest + "\n")
        else:  # a character already printed changed after all: print the whole text again
            self._write("\n" + text + "\n")


def add_generation_arguments(
    parser: argparse.ArgumentParser, *, stages_help: str, prompts_file: bool = False
) -> None:
    """The flags both runtimes' ``run`` commands take: the model, the stage count, the
    prompt, sampling, ``--json`` and ``--trace`` (``prompts_file``: also
    ``--prompts-file``, in place of one prompt)."""
    from runplan.models import DEFAULT_MODEL, MODEL_HELP

    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=MODEL_HELP,
    )
    parser.add_argument("--stages", type=positive_int, default=3, help=stages_help)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the prompt text")
    what.add_argument("--prompt-ids", type=token_ids, help="the prompt as token ids: 1,2,3")
    if prompts_file:
        what.add_argument(
            "--prompts-file",
            type=Path,
            help='a JSON Lines file of prompts ({"prompt": TEXT} or {"prompt_ids": '
            "[IDS]} a line), run on one chain, up to --max-concurrent at once; one JSON "
            "line per prompt is printed as it completes (with --json: one object, "
            "results, once all are done)",
        )
        parser.add_argument(
            "--max-concurrent",
            type=positive_int,
            default=None,
            help="with --prompts-file: prompts in flight at once, batched by the stages; "
            "the others wait (default: up to 64, fewer where the hosts' memory holds "
            "fewer runs' caches)",
        )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template as a user turn (a text "
        "prompt, not token ids)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (32)")
    add_sampling_arguments(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object to stdout; text, progress and logs go to stderr",
    )
    parser.add_argument(
        "--trace",
        type=writable_file,
        default=None,
        help="write Chrome trace events to this file (open in https://ui.perfetto.dev); "
        "checked before the run starts",
    )


def check_generation_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags of ``add_generation_arguments`` that contradict each other: ``--chat`` with
    ``--prompt-ids`` (the template renders text; ids are tokens already: it was dropped
    without a word); a ``--trace`` that is a file of the model (the trace replaced the
    model). One line and exit status 2."""
    if args.chat and getattr(args, "prompt_ids", None) is not None:
        parser.error(
            "argument --chat: the chat template wraps a text prompt; --prompt-ids are "
            "tokens already"
        )
    if args.trace is not None and (model_file := _model_file_at(args.trace, args.model)):
        parser.error(
            f"argument --trace: {str(args.trace)!r} is the model's file {model_file}: "
            "the trace would overwrite it"
        )


def _model_file_at(trace: Path, model: str) -> str | None:
    """The file of the model ``model`` names (the GGUF file, any file of its split set,
    its shards or their manifest) that ``trace`` is, by device and inode (another name,
    a link); ``None`` when it is none of them, or the model cannot be read (the run
    then fails before any trace is written)."""
    try:
        at = os.stat(trace)
    except OSError:  # no file there yet: not the model's
        return None
    try:
        header = GgufHeader.read(resolve_model(model))
    except (GgufError, OSError, ValueError):
        return None
    for path in dict.fromkeys((*header.source_paths, *header.paths)):
        try:
            there = os.stat(path)
        except OSError:
            continue
        if (there.st_dev, there.st_ino) == (at.st_dev, at.st_ino):
            return path
    return None


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` and ``--seed``."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="keep the k likeliest (0: off, the default)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus mass (1: off, the default)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")


def prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer) -> list[int]:
    """The prompt the flags of ``add_generation_arguments`` give: ``--prompt-ids`` as
    they are, or ``--prompt`` encoded (wrapped as a user turn in the model's chat
    template with ``--chat``)."""
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    return encode_prompt(args.prompt, tokenizer, chat=args.chat)


def encode_prompt(text: str, tokenizer: Tokenizer, *, chat: bool) -> list[int]:
    """A prompt's text encoded as ``--prompt`` is (a user turn in the model's chat
    template with ``chat``)."""
    if chat:
        return tokenizer.encode_chat(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
        )
    return tokenizer.encode(text, add_special=True, parse_special=True)


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of either runtime's ``generate`` that the flags of
    ``add_generation_arguments`` set."""
    return {
        "stages": args.stages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "trace": args.trace is not None,
    }
