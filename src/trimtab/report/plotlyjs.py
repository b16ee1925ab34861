"""plotly.js embedded in report.html compressed: the minified bundle is 4.6 MiB, 99% of a debug run's
page (the figures' data: tens of KB), and gzip makes it 1.4 MiB (1.9 MiB in base64). The page
decompresses it itself (the browser's DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 on),
so it still opens offline from one file. Compressing takes 1-4 s: done once per plotly version and
kept in the cache directory (paths.cache_dir).
"""

from __future__ import annotations

import base64
import gzip

import plotly
from plotly.offline import get_plotlyjs

from trimtab.paths import cache_dir
from trimtab.rundir import write_atomic

# decoded and run before any figure is drawn: each figure's call waits on window.plotlyReady (page._figure);
# a browser without DecompressionStream is told so on the page instead of showing empty boxes
LOADER = """<script>
window.plotlyReady = (async () => {
  if (typeof DecompressionStream === 'undefined') {
    document.addEventListener('DOMContentLoaded', () => document.body.insertAdjacentHTML('afterbegin',
      "<p style='color:#b00'>This browser cannot unpack the page's plotly.js (DecompressionStream: Chrome 80, "
      + "Firefox 113, Safari 16.4 or newer): the plots are not drawn.</p>"));
    console.error('no DecompressionStream: plots not drawn');
    throw new Error('no DecompressionStream');  // said once: the figures' calls pass it by
  }
  const text = atob(document.getElementById('plotly-js-gz').textContent.trim());
  const packed = Uint8Array.from(text, c => c.charCodeAt(0));
  const stream = new Blob([packed]).stream().pipeThrough(new DecompressionStream('gzip'));
  const script = document.createElement('script');
  script.textContent = await new Response(stream).text();
  document.head.appendChild(script);  // an inline script runs as it is appended: window.Plotly now set
})();
</script>"""


def packed_plotly_js() -> str:
    """plotly.js gzipped and in base64, from the cache when this plotly version's is there."""
    cached = cache_dir() / f"plotly-{plotly.__version__}.min.js.gz.b64"
    try:
        return cached.read_text()
    except OSError:
        pass
    packed = base64.b64encode(gzip.compress(get_plotlyjs().encode(), 9, mtime=0)).decode()
    try:  # a read-only or full cache costs the compression again next time, never the report
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, packed, durable=False)  # a cache: a crash loses it, never a half file
    except OSError:
        pass
    return packed


def head_scripts() -> str:
    """The page's head: the packed bundle (inert: not JavaScript) and the loader that runs it."""
    return f"<script id='plotly-js-gz' type='application/gzip;base64'>{packed_plotly_js()}</script>\n{LOADER}"
