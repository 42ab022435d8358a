"""Open pages of the built documentation site in headless Chromium and check them.

Each page is loaded in a real browser (Chromium, driven over the Chrome DevTools protocol on a
pipe: no driver, no extra Python package) and must

* load (the ``load`` event fires, no navigation error),
* show a heading (a non-empty ``<h1>``),
* log no console error: no ``console.error``, no uncaught exception, no failed load of a file
  of the site (a resource off the site, such as MathJax from its CDN on an offline machine, is
  printed as a warning only),
* for the pages given with ``--figures``: contain rendered figures, ``<img>`` elements whose
  ``src`` is a ``data:`` URI or a file of ``_images/`` and that the browser decoded.

One screenshot per page (1280x2000) goes to the screenshots folder.

Usage (from the repository root, after building the site)::

    python docs/check_pages.py docs/_build/html \\
        --pages index.html api/methods.html tutorials/01_quickstart.html \\
        --figures tutorials/01_quickstart.html --screenshots docs/_build/screenshots

Exits 0 when every page passes, 1 when one fails, 2 when no Chromium is found (``--browser``
or ``chromium``/``chromium-browser``/``google-chrome`` on ``PATH``).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# what the page reports once loaded: its headings and its images (decoded or not)
_PROBE = """JSON.stringify({
  title: document.title,
  h1: Array.from(document.querySelectorAll('h1'))
    .map(e => e.textContent.replace(/[¶#]$/, '').trim()),
  images: Array.from(document.images).map(i => ({
    src: (i.getAttribute('src') || '').slice(0, 80),
    decoded: i.complete && i.naturalWidth > 0})),
  typeset: document.querySelectorAll('mjx-container').length,
  untypeset: document.querySelectorAll('div.math, span.math').length
    - document.querySelectorAll('div.math mjx-container, span.math mjx-container').length,
})"""


@dataclass
class PageReport:
    """What the browser saw on one page."""

    page: str
    title: str = ""
    h1: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    screenshot: str = ""
    typeset: int = 0
    untypeset: int = 0


def _pipe_fds(commands: int, answers: int) -> None:
    """In the browser's process: the command pipe on fd 3, the answer pipe on fd 4."""
    high = (fcntl.fcntl(commands, fcntl.F_DUPFD, 10), fcntl.fcntl(answers, fcntl.F_DUPFD, 10))
    os.dup2(high[0], 3)
    os.dup2(high[1], 4)


class _Browser:
    """A headless Chromium driven over ``--remote-debugging-pipe`` (fd 3: commands in,
    fd 4: responses and events out, JSON messages ended by NUL)."""

    def __init__(self, executable: str, timeout: float) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="check_pages_")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self._proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={self._profile.name}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: _pipe_fds(to_browser_r, from_browser_w), close_fds=False)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._from_browser, selectors.EVENT_READ)

    def _read_message(self, deadline: float) -> dict[str, Any] | None:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                return None
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe (did it crash?)")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None) -> dict[str, Any]:
        """Send one command and wait for its answer; events read meanwhile are kept."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read_message(deadline)
            if answer is None:
                raise TimeoutError(f"chromium did not answer {method} in {self.timeout}s")
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_event(self, method: str, seconds: float) -> bool:
        """Read events for up to ``seconds``; True once ``method`` is seen."""
        deadline = time.monotonic() + seconds
        while True:
            if any(e.get("method") == method for e in self.events):
                return True
            event = self._read_message(deadline)
            if event is None:
                return False
            self.events.append(event)

    def drain(self, seconds: float) -> None:
        """Keep reading events for ``seconds`` (late scripts, images, MathJax)."""
        deadline = time.monotonic() + seconds
        while (event := self._read_message(deadline)) is not None:
            self.events.append(event)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._profile.cleanup()


def _errors_of(events: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The console errors of a page's events, and the warnings (external loads failed)."""
    errors: list[str] = []
    warnings: list[str] = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            errors.append(f"uncaught exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = " ".join(str(a.get("value", a.get("description", "")))
                            for a in params.get("args", []))
            errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            line = f"{entry.get('source', 'log')} error: {entry.get('text', '')} " \
                   f"{entry.get('url', '')}".strip()
            # a resource off the site (a CDN) is the network's business, not the site's:
            # offline machines report it, networked ones do not
            external = entry.get("source") == "network" and \
                entry.get("url", "").startswith(("http:", "https:"))
            (warnings if external else errors).append(line)
    return errors, warnings


def check_page(browser: _Browser, url: str, name: str, screenshot: Path | None,
               settle: float = 1.5) -> PageReport:
    """Load ``url`` in a fresh tab of ``browser`` and report what it shows.

    Args:
        browser (_Browser): the running headless browser.
        url (str): the page's ``file://`` URL.
        name (str): the page's path in the site, for the report.
        screenshot (Path | None): where to write a PNG screenshot; None for none.
        settle (float): seconds to keep listening after the ``load`` event.

    Returns:
        PageReport: the page's title, ``<h1>`` texts, images and console errors.
    """
    report = PageReport(page=name)
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget",
                           {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        browser.send(f"{domain}.enable", session=session)
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": 1280, "height": 2000, "deviceScaleFactor": 1, "mobile": False},
                 session=session)
    browser.events.clear()
    navigation = browser.send("Page.navigate", {"url": url}, session=session)
    if navigation.get("errorText"):
        report.errors.append(f"navigation failed: {navigation['errorText']}")
    elif not browser.wait_event("Page.loadEventFired", browser.timeout):
        report.errors.append(f"no load event in {browser.timeout}s")
    browser.drain(settle)
    probe = browser.send("Runtime.evaluate", {"expression": _PROBE, "returnByValue": True},
                         session=session)
    found = json.loads(probe.get("result", {}).get("value") or "{}")
    report.title = found.get("title", "")
    report.h1 = [h for h in found.get("h1", []) if h]
    report.images = found.get("images", [])
    report.typeset = int(found.get("typeset", 0))
    report.untypeset = int(found.get("untypeset", 0))
    errors, warnings = _errors_of([e for e in browser.events if e.get("sessionId") == session])
    report.errors += errors
    report.warnings += warnings
    if screenshot is not None:
        shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        report.screenshot = str(screenshot)
    browser.send("Target.closeTarget", {"targetId": target})
    return report


def _figures(report: PageReport) -> list[dict[str, Any]]:
    return [i for i in report.images
            if i["decoded"] and (i["src"].startswith("data:image/") or "_images/" in i["src"])]


def find_browser(explicit: str | None = None) -> str | None:
    """The Chromium executable: ``explicit`` when given, else the first on ``PATH``."""
    if explicit:
        return shutil.which(explicit) or (explicit if Path(explicit).is_file() else None)
    return next((path for name in _BROWSERS if (path := shutil.which(name))), None)


def main(argv: list[str] | None = None) -> int:
    """Command line: check the pages, print one line per page, write the screenshots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, nargs="?", default=Path("docs/_build/html"))
    parser.add_argument("--pages", nargs="+", default=["index.html", "api/methods.html",
                                                         "tutorials/01_quickstart.html"])
    parser.add_argument("--figures", nargs="*", default=["tutorials/01_quickstart.html"],
                        help="pages that must show rendered figures")
    parser.add_argument("--math", nargs="*", default=[],
                        help="pages whose equations must be typeset by MathJax (shipped with "
                             "the site: no network needed)")
    parser.add_argument("--screenshots", type=Path, default=Path("docs/_build/screenshots"))
    parser.add_argument("--browser", default=None, help="the Chromium executable")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    executable = find_browser(args.browser)
    if executable is None:
        print("check_pages: no chromium found (install Debian's chromium)", file=sys.stderr)
        return 2
    site = args.site.resolve()
    failed = False
    browser = _Browser(executable, args.timeout)
    try:
        version = browser.send("Browser.getVersion").get("product", executable)
        print(f"check_pages: {version}")
        for name in args.pages:
            path = site / name
            if not path.is_file():
                print(f"FAIL {name}: no such page in {site}")
                failed = True
                continue
            shot = args.screenshots / (name.replace("/", "_").removesuffix(".html") + ".png")
            report = check_page(browser, path.as_uri(), name, shot)
            problems = list(report.errors)
            if not report.h1:
                problems.append("no <h1> heading")
            figures = _figures(report)
            if name in args.figures and not figures:
                problems.append(f"no rendered figure among {len(report.images)} <img>")
            if name in args.math and (not report.typeset or report.untypeset):
                problems.append(f"equations not typeset: {report.typeset} typeset, "
                                f"{report.untypeset} left as TeX")
            status = "FAIL" if problems else "ok"
            print(f"{status:4} {name}: h1={report.h1!r} images={len(report.images)} "
                  f"figures={len(figures)} equations={report.typeset} "
                  f"console_errors={len(report.errors)} "
                  f"screenshot={report.screenshot}")
            for problem in problems:
                print(f"     {problem}")
            for warning in report.warnings:
                print(f"     warning (not a failure): {warning}")
            failed |= bool(problems)
    finally:
        browser.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
