"""Writes the body of requirements.lock: each pin `NAME==VERSION` with the sha256 of every file pip may install for it.

    pip freeze --all | LC_ALL=C sort -f | python3 tools/lock_hashes.py > body    (what tools/bootstrap.sh --freeze runs)

Which files: every distribution file of the pinned version that pip could install on the platform the project
supports, Linux x86_64 (glibc) with CPython 3.11: the wheels whose tags that interpreter accepts on any manylinux or
linux x86_64 (cp311, abi3 and none ABIs, py3 and `any` wheels), and the sdist where there is one. So a pip that picks
another compatible file than this machine's pip did (another manylinux wheel, the sdist) still finds its hash.

Where from: every source pip is configured with (`pip config list`, which includes PIP_* variables), all of them: the
index (PyPI unless index-url says otherwise; skipped under no-index), every extra index and every find-links folder or
page, plus those given with --index / --find-links. Indexes are read through the JSON simple API (PEP 691) where they
serve it, else as PEP 503 pages (file:// ones too); a file listed without a sha256 is downloaded (or read, when local)
and hashed, and so is every matching file of a find-links folder. torch's +cpu wheel is not on PyPI: its hash comes
from find-links or from the PyTorch CPU index, whichever pip is configured with.

Output, one block per pin in input order, the files' hashes sorted by file name and each file named in a comment below
(pip reads the block as one requirement; the comment lines are ignored):

    numpy==2.4.6 \\
        --hash=sha256:89cd... \\
        --hash=sha256:f3a3...
        # numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
        # numpy-2.4.6.tar.gz

Fails, naming the package, when a pin has no such file in any source, or when two sources hold different files under
one name (a hermetic lock takes neither). Needs the network for remote indexes; nothing is written on failure.
"""

import argparse
import concurrent.futures
import hashlib
import html.parser
import json
import pathlib
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

try:
    from packaging import tags
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # a venv without packaging installed still has pip's copy
    from pip._vendor.packaging import tags
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import InvalidVersion, Version

PYPI_SIMPLE = "https://pypi.org/simple/"
PYTHON_VERSION = (3, 11)
INTERPRETER = "cp311"
# Linux x86_64 with glibc (Debian): every manylinux tag a newer glibc would also accept, and plain linux wheels that
# a find-links folder may hold. musllinux, other architectures and other operating systems are not supported.
PLATFORMS = (["linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
             + [f"manylinux_2_{minor}_x86_64" for minor in range(5, 100)])
SUPPORTED_TAGS = frozenset(
    str(tag) for tag in [*tags.cpython_tags(PYTHON_VERSION, abis=[INTERPRETER], platforms=PLATFORMS),
                         *tags.compatible_tags(PYTHON_VERSION, INTERPRETER, platforms=PLATFORMS)])
SDIST_SUFFIXES = (".tar.gz", ".zip", ".tar.bz2", ".tar.xz", ".tgz", ".tar")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^=;\s\\]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})\b")
JSON_SIMPLE = "application/vnd.pypi.simple.v1+json"
TIMEOUT_S = 120
TRUE = ("1", "true", "yes", "on")


class LockError(Exception):
    """A reason the lock cannot be written, for one line on stderr."""


def parse_file_name(filename):
    """(canonical name, Version, {"py-abi-platform" tag} of a wheel or None for an sdist) of a file name, or None."""
    if filename.endswith(".whl"):
        parts = filename[:-len(".whl")].split("-")
        if len(parts) not in (5, 6):
            return None
        name, version = parts[0], parts[1]
        pythons, abis, platforms = (part.split(".") for part in parts[-3:])
        file_tags = {f"{p}-{a}-{plat}" for p in pythons for a in abis for plat in platforms}
    else:
        suffix = next((s for s in SDIST_SUFFIXES if filename.endswith(s)), None)
        if suffix is None:
            return None
        name, _, version = filename[:-len(suffix)].rpartition("-")
        file_tags = None
        if not name:
            return None
    try:
        return canonicalize_name(name), Version(version), file_tags
    except InvalidVersion:
        return None


def installable(filename, name, version):
    """True when pip could install `filename` for the pin name==version on a supported platform."""
    parsed = parse_file_name(filename)
    if parsed is None or parsed[0] != canonicalize_name(name) or parsed[1] != Version(version):
        return False
    return parsed[2] is None or not parsed[2].isdisjoint(SUPPORTED_TAGS)


def parse_lock(text):
    """{pin name as written: (version, [sha256, ...], [file name, ...])} of a lock in this module's format.

    Checks the layout pip relies on: a pin line, then its --hash lines, each line but the block's last ending in a
    backslash; the file-name comments come after the block."""
    pins = {}
    current, continued = None, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if continued and not line.startswith("    --hash="):
            raise LockError(f"line {number}: the line before ends in a backslash, this is no --hash line: {line!r}")
        if not stripped or stripped.startswith("#"):
            if current is not None and line.startswith("    # "):
                pins[current][2].append(stripped[1:].strip())
            else:
                current = None
            continue
        match = PIN.match(line)
        if match:
            current = match.group(1)
            if current in pins:
                raise LockError(f"line {number}: {current} pinned twice")
            pins[current] = (match.group(2), [], [])
        elif not continued:
            raise LockError(f"line {number}: not a pin `name==version` or one of its --hash lines: {line!r}")
        pins[current][1].extend(HASH.findall(line))
        continued = stripped.endswith("\\")
    if continued:
        raise LockError("the last line ends in a backslash")
    return pins


def format_pin(name, version, files):
    """A lock block for name==version from {file name: sha256}."""
    names = sorted(files)
    lines = [f"{name}=={version} \\"]
    lines += [f"    --hash=sha256:{files[f]} \\" for f in names]
    lines[-1] = lines[-1][:-2]
    lines += [f"    # {f}" for f in names]
    return "\n".join(lines)


def _sha256_of_path(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_of_url(url):
    if url.startswith("file:"):
        return _sha256_of_path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        for block in iter(lambda: response.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href") if tag == "a" else None
        if href:
            self.hrefs.append(href)


def _read(url):
    """(body bytes, content type) of a URL; a file:// folder reads as its index.html. None when not found."""
    if url.startswith("file:"):
        path = pathlib.Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if path.is_dir():
            path = path / "index.html"
        if not path.is_file():
            return None
        body = path.read_bytes()
        return body, JSON_SIMPLE if body.lstrip().startswith(b"{") else "text/html"
    request = urllib.request.Request(url, headers={
        "Accept": f"{JSON_SIMPLE}, text/html;q=0.1",
        "User-Agent": "ppo_ops-lock-hashes"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise LockError(f"{url}: HTTP {error.code}") from error
    except (urllib.error.URLError, OSError) as error:
        raise LockError(f"{url}: {getattr(error, 'reason', error)}") from error


def _listed_files(page_url, body, content_type):
    """[(file name, url, sha256 or None)] listed on an index or find-links page."""
    if JSON_SIMPLE in content_type:
        return [(f["filename"], urllib.parse.urljoin(page_url, f["url"]), f.get("hashes", {}).get("sha256"))
                for f in json.loads(body)["files"]]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    files = []
    for href in parser.hrefs:
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        filename = urllib.parse.unquote(urllib.parse.urlparse(url).path.rsplit("/", 1)[-1])
        digest = dict(urllib.parse.parse_qsl(fragment)).get("sha256")
        files.append((filename, url, digest))
    return files


def _files_in_source(source, name, version):
    """{file name: sha256} of the installable files of name==version in one source ("index URL" or "links PATH")."""
    kind, location = source.split(" ", 1)
    if kind == "links" and ("://" not in location or location.startswith("file:")):
        folder = pathlib.Path(urllib.request.url2pathname(urllib.parse.urlparse(location).path)
                              if location.startswith("file:") else location)
        if folder.is_dir():
            return {p.name: _sha256_of_path(p) for p in sorted(folder.iterdir())
                    if p.is_file() and installable(p.name, name, version)}
        if not folder.exists():
            return {}
        location = folder.absolute().as_uri()  # a local page of links
    page_url = location.rstrip("/") + f"/{canonicalize_name(name)}/" if kind == "index" else location
    page = _read(page_url)
    if page is None:
        return {}
    found = {}
    for filename, url, digest in _listed_files(page_url, *page):
        if installable(filename, name, version):
            found[filename] = digest or _sha256_of_url(url)
    return found


def pip_sources(python=sys.executable):
    """The sources pip is configured with here, as "index URL" / "links PATH" strings, from `pip config list`."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        raise LockError(f"pip config list failed: {listed.stderr.strip()}")
    settings = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        option = key.rpartition(".")[2]
        try:
            values = shlex.split(value)
        except ValueError:
            values = [value.strip("'\"")]
        settings.setdefault(option, []).extend(v for w in values for v in w.split())
    sources = []
    if not any(v.lower() in TRUE for v in settings.get("no-index", [])):
        sources += [f"index {url}" for url in settings.get("index-url", []) or [PYPI_SIMPLE]]
        sources += [f"index {url}" for url in settings.get("extra-index-url", [])]
    sources += [f"links {link}" for link in settings.get("find-links", [])]
    return list(dict.fromkeys(sources))


def hashed_pins(pins, sources, workers=8):
    """{(name, version): {file name: sha256}} over every source; LockError on a missing or conflicting file."""
    jobs = [(pin, source) for pin in pins for source in sources]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda job: _files_in_source(job[1], *job[0]), jobs))
    found = {pin: {} for pin in pins}
    seen_in = {}
    for (pin, source), files in zip(jobs, results):
        for filename, digest in files.items():
            known = found[pin].setdefault(filename, digest)
            if known != digest:
                raise LockError(f"{filename}: {seen_in[pin, filename]} gives sha256 {known}, {source} gives {digest}; "
                                "two different files under one name: find out which is the published one")
            seen_in.setdefault((pin, filename), source)
    missing = [f"{name}=={version}" for (name, version), files in found.items() if not files]
    if missing:
        raise LockError(f"no file that pip could install on CPython 3.11, Linux x86_64 for {', '.join(missing)} in "
                        f"{'; '.join(sources)}")
    return found


def read_pins(text):
    """[(name, version)] of `name==version` lines (pip freeze's output); other lines are an error."""
    pins = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = PIN.match(line.strip())
        if not match or match.end() != len(line.strip()):
            raise LockError(f"not an exact pin name==version: {line!r}")
        pins.append((match.group(1), match.group(2)))
    return pins


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", action="append", default=[], help="another index (simple API root URL)")
    parser.add_argument("--find-links", action="append", default=[], help="another find-links folder or page")
    parser.add_argument("--no-pip-config", action="store_true", help="only the sources given on the command line")
    args = parser.parse_args(argv)
    try:
        pins = read_pins(sys.stdin.read())
        sources = [] if args.no_pip_config else pip_sources()
        sources += [f"index {url}" for url in args.index] + [f"links {link}" for link in args.find_links]
        if not sources:
            raise LockError("no index and no find-links to take the files from")
        found = hashed_pins(pins, list(dict.fromkeys(sources)))
    except LockError as error:
        print(f"lock_hashes: {error}", file=sys.stderr)
        return 1
    print("\n".join(format_pin(name, version, found[name, version]) for name, version in pins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
