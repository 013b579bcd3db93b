/** Small SVG drawings (no plotting library): a sparkline and a line chart with markers. */

const NS = 'http://www.w3.org/2000/svg';

function el<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number>
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, String(v));
  }
  return node;
}

function extent(values: number[]): [number, number] {
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  if (!isFinite(lo) || !isFinite(hi)) {
    return [0, 1];
  }
  if (hi - lo < 1e-12) {
    lo -= 0.5;
    hi += 0.5;
  }
  return [lo, hi];
}

/** A 80x18 polyline of the values (empty box when there are fewer than two). */
export function sparkline(values: number[], width = 80, height = 18): SVGSVGElement {
  const svg = el('svg', {
    class: 'jp-OpenRL-sparkline',
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: 'img',
    'aria-label': values.length
      ? `reward, last ${values[values.length - 1].toFixed(3)}`
      : 'no reward yet'
  });
  if (values.length < 2) {
    return svg;
  }
  const [lo, hi] = extent(values);
  const pts = values.map((v, i) => {
    const x = (i / (values.length - 1)) * (width - 2) + 1;
    const y = height - 1 - ((v - lo) / (hi - lo)) * (height - 2);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  svg.appendChild(el('polyline', { points: pts.join(' '), fill: 'none' }));
  return svg;
}

export interface ISeries {
  x: number[];
  y: number[];
}

/**
 * A line chart of one series with a point per value (`circle.jp-OpenRL-point`), axes labels, and
 * vertical dashed markers at `markers` (x values, e.g. where the reward version changed).
 */
export function lineChart(
  title: string,
  series: ISeries,
  markers: { x: number; label: string }[] = [],
  xLabel = 'step',
  width = 560,
  height = 200
): SVGSVGElement {
  const pad = { l: 48, r: 12, t: 22, b: 24 };
  const svg = el('svg', {
    class: 'jp-OpenRL-chart',
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: 'img',
    'aria-label': `${title}: ${series.y.length} points`
  });
  const heading = el('text', { x: pad.l, y: 14, class: 'jp-OpenRL-chart-title' });
  heading.textContent = title;
  svg.appendChild(heading);
  const n = series.y.length;
  if (n === 0) {
    const empty = el('text', { x: pad.l, y: height / 2, class: 'jp-OpenRL-chart-empty' });
    empty.textContent = 'no data yet';
    svg.appendChild(empty);
    return svg;
  }
  const [x0, x1] = n > 1 ? extent(series.x) : [series.x[0] - 1, series.x[0] + 1];
  const [y0, y1] = extent(series.y);
  const w = width - pad.l - pad.r;
  const h = height - pad.t - pad.b;
  const sx = (x: number) => pad.l + ((x - x0) / (x1 - x0)) * w;
  const sy = (y: number) => pad.t + h - ((y - y0) / (y1 - y0)) * h;
  svg.appendChild(
    el('rect', { x: pad.l, y: pad.t, width: w, height: h, class: 'jp-OpenRL-chart-frame' })
  );
  for (const [value, y] of [
    [y1, pad.t + 4],
    [y0, pad.t + h]
  ]) {
    const label = el('text', { x: pad.l - 4, y, class: 'jp-OpenRL-chart-axis', 'text-anchor': 'end' });
    label.textContent = Number(value).toPrecision(3);
    svg.appendChild(label);
  }
  for (const [value, anchor] of [
    [x0, 'start'],
    [x1, 'end']
  ] as [number, string][]) {
    const label = el('text', {
      x: sx(value),
      y: height - 6,
      class: 'jp-OpenRL-chart-axis',
      'text-anchor': anchor
    });
    label.textContent = `${xLabel} ${Math.round(value)}`;
    svg.appendChild(label);
  }
  for (const m of markers) {
    if (m.x < x0 || m.x > x1) {
      continue;
    }
    svg.appendChild(
      el('line', {
        x1: sx(m.x),
        x2: sx(m.x),
        y1: pad.t,
        y2: pad.t + h,
        class: 'jp-OpenRL-chart-marker'
      })
    );
    const label = el('text', { x: sx(m.x) + 3, y: pad.t + 10, class: 'jp-OpenRL-chart-axis' });
    label.textContent = m.label;
    svg.appendChild(label);
  }
  const pts = series.y.map((v, i) => `${sx(series.x[i]).toFixed(1)},${sy(v).toFixed(1)}`);
  svg.appendChild(el('polyline', { points: pts.join(' '), class: 'jp-OpenRL-chart-line' }));
  series.y.forEach((v, i) => {
    const dot = el('circle', {
      cx: sx(series.x[i]).toFixed(1),
      cy: sy(v).toFixed(1),
      r: 2.5,
      class: 'jp-OpenRL-point'
    });
    const tip = el('title', {});
    tip.textContent = `${xLabel} ${series.x[i]}: ${v}`;
    dot.appendChild(tip);
    svg.appendChild(dot);
  });
  return svg;
}
