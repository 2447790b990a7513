"""The status page: one HTML document, its style and script inline, nothing fetched elsewhere.

The server renders the job's snapshot into the page (so it shows the job at once), and the
page's script draws it and fetches ``status.json`` every second to draw it again. Text is set
with ``textContent`` only: what the tasks report is never read as HTML.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["render_page"]

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em; color: #1d2430; }
h1 { font-size: 1.3em; margin: 0 0 .4em; }
#job { margin: 0 0 .8em; }
#job span { margin-right: 1.4em; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid #d8dde6; padding: .3em .6em; text-align: left; }
th { background: #eef1f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.straggler { background: #fff3cd; }
tr.lost { background: #f8d7da; color: #6b1a21; }
tr.done { color: #6c757d; }
.note { font-weight: 600; }
#events { margin-top: 1em; font-size: .9em; color: #3b4452; }
#stale { color: #a61b29; }
"""

_SCRIPT = """
(function () {
  const token = new URLSearchParams(location.search).get('token');
  const headers = token ? {'X-Phalanx-Token': token} : {};
  const el = (tag, text, cls) => {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  };
  const num = (v, digits) => (v === null || v === undefined) ? '' : Number(v).toFixed(digits);
  const pct = (v) => (v === null || v === undefined) ? '' : (100 * v).toFixed(0) + '%';
  const mib = (v) => (v === null || v === undefined) ? '' : (v / 1048576).toFixed(0) + ' MiB';
  const secs = (v) => (v === null || v === undefined) ? 'unknown' :
    (v >= 3600 ? (v / 3600).toFixed(1) + ' h' : v >= 60 ? (v / 60).toFixed(1) + ' min' : v.toFixed(0) + ' s');
  function note(w) {
    if (w.state === 'lost') return 'lost: ' + (w.lost_reason || 'no reports');
    if (w.straggler) return 'straggler: the other workers wait for it';
    if (w.state === 'joining') return 'joining the job';
    if (w.state === 'done') return 'done';
    return '';
  }
  function draw(view) {
    const job = view.job, counts = job.workers;
    const summary = document.getElementById('job');
    summary.replaceChildren(
      el('span', 'elapsed ' + secs(job.elapsed_seconds)),
      el('span', 'membership epoch ' + (job.membership_epoch === null ? 'n/a' : job.membership_epoch)),
      el('span', 'step ' + (job.step === null ? '-' : job.step) +
        (job.total_steps ? ' of ' + job.total_steps : '')),
      el('span', 'ETA ' + (job.total_steps ? secs(job.eta_seconds) : 'unknown (no step count)')),
      el('span', counts.running + ' running, ' + counts.joining + ' joining, ' + counts.lost + ' lost, ' +
        counts.done + ' done'),
      el('span', 'straggler: ' + (job.straggler || 'none'), 'note'));
    const body = document.getElementById('workers');
    body.replaceChildren(...view.workers.map((w) => {
      const row = el('tr', null, w.state === 'lost' ? 'lost' : w.straggler ? 'straggler' : w.state);
      row.dataset.task = w.task;
      row.append(el('td', w.task), el('td', w.state), el('td', note(w), 'note'), el('td', w.host),
        el('td', w.pid, 'num'), el('td', w.step, 'num'), el('td', num(w.steps_per_second, 2), 'num'),
        el('td', pct(w.collective_wait_fraction), 'num'), el('td', mib(w.resident_memory_bytes), 'num'),
        el('td', w.last_error || ''));
      return row;
    }));
    const ps = view.parameter_server, psBox = document.getElementById('ps');
    psBox.replaceChildren();
    if (ps) {
      psBox.append(el('h2', 'Parameter servers'), el('p', 'closures lost: ' + ps.lost_closures +
        ', re-scheduled: ' + ps.rescheduled_closures));
      for (const [worker, c] of Object.entries(ps.closures)) psBox.append(el('p', worker + ': ' +
        num(c.per_second, 2) + ' closures/s, ' + c.done + ' done'));
      for (const [task, p] of Object.entries(ps.ps_tasks)) psBox.append(el('p', task + ': ' + p.state +
        ', ' + num(p.requests_per_second, 1) + ' requests/s'));
    }
    const events = document.getElementById('events');
    events.replaceChildren(el('h2', 'Events (UTC)'), ...view.events.slice(-20).reverse().map((e) =>
      el('div', new Date(e.time * 1000).toISOString().slice(11, 19) + ' ' + e.task + ' ' + e.event +
        ': ' + e.reason)));
    document.getElementById('stale').textContent = '';
  }
  async function refresh() {
    try {
      const answer = await fetch('status.json', {cache: 'no-store', headers: headers});
      if (!answer.ok) throw new Error('HTTP ' + answer.status);
      draw(await answer.json());
    } catch (e) {
      document.getElementById('stale').textContent =
        'cannot reach the job (' + e.message + '): showing the last view';
    }
  }
  draw(JSON.parse(document.getElementById('initial').textContent));
  setInterval(refresh, 1000);
})();
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>phalanx job status</title>
<style>{style}</style></head>
<body>
<h1>phalanx job status</h1>
<div id="job"></div><div id="stale"></div>
<table><thead><tr><th>task</th><th>state</th><th>note</th><th>host</th><th>pid</th><th>step</th>
<th>steps/s</th><th>collective wait</th><th>memory</th><th>last error</th></tr></thead>
<tbody id="workers"></tbody></table>
<div id="ps"></div><div id="events"></div>
<script type="application/json" id="initial">{initial}</script>
<script>{script}</script>
</body></html>
"""


def render_page(snapshot: dict[str, Any]) -> str:
    """The page, with ``snapshot`` (`Board.snapshot`) as its first view."""
    # inside <script>, "</" would end the element: JSON's \\u003c escape keeps it data
    initial = json.dumps(snapshot).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return _PAGE.format(style=_STYLE, initial=initial, script=_SCRIPT)
