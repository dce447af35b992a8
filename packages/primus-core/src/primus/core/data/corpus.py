"""The bundled corpus: docstrings of a fixed list of standard-library modules, plus pydoc's help topics.

Every Python install carries this text, so Primus can train a tokenizer and a tiny model with no network and
no shipped data. The walk is deterministic: modules in a fixed sorted order, members sorted by name, each
docstring kept once (first occurrence). Modules with import side effects (``this``, ``antigravity``,
``tkinter``, ``turtle``, ``idlelib``), optional C extensions (``ssl``, ``sqlite3``, ``lzma``, ``bz2``), modules
deprecated or removed in 3.12/3.13, and modules whose members change with the platform (``os``, ``socket``,
``signal``, ``subprocess``, ``asyncio``...) are left out, so one Python version gives the same text on every OS.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import itertools
import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from functools import lru_cache

#: Bump when the walk below changes: the bundled tokenizer and token caches are keyed on it.
CORPUS_VERSION = 2  # 2: walked in a clean interpreter (documents)

MODULES: tuple[str, ...] = (
    "abc",
    "argparse",
    "ast",
    "asyncio.base_events",
    "asyncio.events",
    "asyncio.futures",
    "asyncio.locks",
    "asyncio.protocols",
    "asyncio.queues",
    "asyncio.runners",
    "asyncio.streams",
    "asyncio.tasks",
    "asyncio.timeouts",
    "asyncio.transports",
    "base64",
    "bdb",
    "bisect",
    "builtins",
    "cProfile",
    "calendar",
    "cmath",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "colorsys",
    "compileall",
    "concurrent.futures._base",
    "concurrent.futures.process",
    "concurrent.futures.thread",
    "configparser",
    "contextlib",
    "contextvars",
    "copy",
    "copyreg",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "email.base64mime",
    "email.charset",
    "email.contentmanager",
    "email.encoders",
    "email.errors",
    "email.feedparser",
    "email.generator",
    "email.header",
    "email.headerregistry",
    "email.iterators",
    "email.message",
    "email.parser",
    "email.policy",
    "email.quoprimime",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib",
    "importlib.abc",
    "importlib.machinery",
    "importlib.metadata",
    "importlib.resources",
    "importlib.util",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "json.encoder",
    "json.scanner",
    "keyword",
    "linecache",
    "logging",
    "logging.config",
    "logging.handlers",
    "mailbox",
    "math",
    "mimetypes",
    "modulefinder",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "runpy",
    "sched",
    "secrets",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "stat",
    "statistics",
    "string",
    "stringprep",
    "struct",
    "symtable",
    "tabnanny",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unittest",
    "unittest.async_case",
    "unittest.case",
    "unittest.loader",
    "unittest.main",
    "unittest.mock",
    "unittest.result",
    "unittest.runner",
    "unittest.signals",
    "unittest.suite",
    "unittest.util",
    "urllib",
    "urllib.error",
    "urllib.parse",
    "urllib.request",
    "urllib.response",
    "urllib.robotparser",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "wsgiref",
    "wsgiref.handlers",
    "wsgiref.headers",
    "wsgiref.simple_server",
    "wsgiref.util",
    "wsgiref.validate",
    "xml",
    "xml.dom",
    "xml.dom.minidom",
    "xml.dom.pulldom",
    "xml.etree",
    "xml.etree.ElementTree",
    "xml.sax",
    "xml.sax.handler",
    "xml.sax.saxutils",
    "xml.sax.xmlreader",
    "xmlrpc.client",
    "xmlrpc.server",
    "zipapp",
    "zipfile",
    "zoneinfo",
)


def _owned(obj: object, module: str) -> bool:
    # Keep what the module defines itself (or its C accelerator, e.g. functools <- _functools), not re-exports.
    owner = getattr(obj, "__module__", None)
    return owner in (module, "_" + module.rsplit(".", 1)[-1])


def _doc(obj: object) -> str | None:
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    return inspect.cleandoc(doc).strip() or None


def _module_docs(name: str) -> Iterator[str | None]:
    module = importlib.import_module(name)
    yield _doc(module)
    members = vars(module)
    for attr in sorted(members):
        obj = members[attr]
        if attr.startswith("__") or not (inspect.isclass(obj) or inspect.isroutine(obj)) or not _owned(obj, name):
            continue
        yield _doc(obj)
        if inspect.isclass(obj):
            for member in sorted(vars(obj)):
                yield _doc(vars(obj)[member])


def _help_topics() -> Iterator[str]:
    # The text of help('topics'): the language reference sections pydoc shows offline.
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out; the corpus id records which case this is
        return
    for key in sorted(topics):
        yield topics[key].strip()


@lru_cache(maxsize=1)
def documents() -> tuple[str, ...]:
    """All docstrings of :data:`MODULES`, then the help topics, in a fixed order, each once (about 1.6 MB on 3.11).

    Walked in a fresh interpreter with nothing but the standard library (``-I -S``: no site, no .pth files): a
    library imported before can patch stdlib functions (typing_extensions replaces ``typing._collect_parameters``,
    torch.package ``inspect.getfile``), which the walk then takes for re-exports and leaves out. In-process, a run
    that imported torch first built 5,360 documents and one that had not 5,363, under the same cache key."""
    proc = subprocess.run(
        [sys.executable, "-I", "-S", __file__], capture_output=True, text=True, encoding="ascii", check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"walking the bundled corpus in {sys.executable} failed: {proc.stderr[-2000:]}")
    return tuple(json.loads(proc.stdout))


def _walk() -> tuple[str, ...]:
    seen: set[str] = set()
    out: list[str] = []
    with warnings.catch_warnings():  # importing and touching deprecated names (typing.io, ...) warns
        warnings.simplefilter("ignore")
        for doc in itertools.chain(*(_module_docs(name) for name in MODULES), _help_topics()):
            if doc and doc not in seen:
                seen.add(doc)
                out.append(doc)
    return tuple(out)


def corpus_id() -> str:
    """A short key for the corpus this interpreter produces, cheap to compute (no module walk)."""
    topics = importlib.util.find_spec("pydoc_data") is not None
    key = f"v{CORPUS_VERSION}|{sys.implementation.name}|{sys.version_info[:3]}|{topics}|{','.join(MODULES)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


if __name__ == "__main__":  # documents(): the walk, in a clean interpreter, as JSON (ASCII) on stdout
    json.dump(list(_walk()), sys.stdout)
