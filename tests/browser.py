"""Headless Chromium for the report tests (no conftest needed: import it).

How a page is checked: the HTML is copied with a probe <script> inserted first in <head>, before
the report's Content-Security-Policy <meta> (a meta CSP governs only what comes after it, so the
probe runs while the report itself stays script-free). The probe records every error event
(script errors, and resources that fail to load, caught in the capture phase), every CSP
violation (any attempt to reach a network resource), console.error/console.warn calls, and at
`load` the state of every <img> and every entry of the resource timeline, then writes all of it
as JSON into the DOM. `chromium --dump-dom` prints the DOM after load, and the test reads the
JSON back. This is sturdier than parsing Chromium's stderr, which carries unrelated noise (D-Bus,
GPU and sandbox messages) whose format changes between versions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

PROBE = """<script>
(function () {
  var log = [];
  window.addEventListener('error', function (e) {
    var t = e.target;
    log.push('error: ' + (e.message || (t && (t.currentSrc || t.src || t.href)) || String(t && t.tagName)));
  }, true);
  document.addEventListener('securitypolicyviolation', function (e) {
    log.push('csp: ' + e.violatedDirective + ' blocked ' + e.blockedURI);
  });
  ['error', 'warn'].forEach(function (k) {
    var original = console[k];
    console[k] = function () {
      log.push('console.' + k + ': ' + Array.prototype.join.call(arguments, ' '));
      return original.apply(console, arguments);
    };
  });
  window.addEventListener('load', function () {
    var images = Array.prototype.map.call(document.images, function (img) {
      var fig = img.closest('figure');
      return {chart: fig ? fig.getAttribute('data-chart') : null, complete: img.complete,
              width: img.naturalWidth, height: img.naturalHeight, shown_width: img.clientWidth,
              scheme: img.src.split(':')[0]};
    });
    var probe = document.createElement('script');
    probe.type = 'application/json';
    probe.id = '__probe__';
    probe.textContent = JSON.stringify({
      errors: log, images: images,
      resources: performance.getEntriesByType('resource').map(function (r) { return r.name; }),
      viewport: window.innerWidth, page_width: document.documentElement.scrollWidth
    });
    document.body.appendChild(probe);
  });
})();
</script>"""


def find_chromium() -> str | None:
    """The Chromium binary, or None. $CHROMIUM overrides the search."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def require_chromium() -> str:
    """Chromium, or skip the test -- but only outside CI: in CI (CI=true) a missing browser fails."""
    path = find_chromium()
    if path:
        return path
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI is set but no Chromium was found (.ci/run installs Debian's `chromium`)")
    pytest.skip("chromium is not installed (apt-get install -y chromium); CI does not skip this")


def _flags(width: int, height: int, user_data: str) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
            f"--user-data-dir={user_data}", f"--window-size={width},{height}", "--virtual-time-budget=5000"]


@dataclass
class Rendered:
    dom: str
    probe: dict


def render(html_path: Path, width: int = 1280, height: int = 2000, timeout: float = 60) -> Rendered:
    """Load the page in headless Chromium with the probe; the DOM after load and the probe's JSON."""
    chromium = require_chromium()
    page = html_path.read_text()
    if "<head>" not in page:
        raise AssertionError("the page has no <head>")
    with tempfile.TemporaryDirectory() as tmp:
        probed = Path(tmp) / html_path.name
        probed.write_text(page.replace("<head>", "<head>" + PROBE, 1))
        result = subprocess.run([chromium, *_flags(width, height, str(Path(tmp) / "profile")), "--dump-dom",
                                 probed.as_uri()], capture_output=True, text=True, timeout=timeout)
    match = re.search(r'<script type="application/json" id="__probe__">(.*?)</script>', result.stdout, re.S)
    if not match:
        raise AssertionError(f"the probe did not report (chromium rc {result.returncode}): {result.stderr[-2000:]}")
    return Rendered(dom=result.stdout, probe=json.loads(match.group(1)))


def screenshot(html_path: Path, png_path: Path, width: int, height: int, timeout: float = 60) -> Path:
    chromium = require_chromium()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([chromium, *_flags(width, height, str(Path(tmp) / "profile")), f"--screenshot={png_path}",
                        html_path.resolve().as_uri()], capture_output=True, text=True, timeout=timeout, check=True)
    return png_path
