import { describe, expect, it } from 'vitest';
import { escapeXml, logTicks, renderBars, renderCdf } from './svg.ts';

const wellFormed = (svg: string): void => {
  expect(svg.startsWith('<svg xmlns="http://www.w3.org/2000/svg"')).toBe(true);
  expect(svg.trimEnd().endsWith('</svg>')).toBe(true);
  expect(svg).not.toMatch(/NaN|undefined|Infinity/);
};

describe('renderCdf', () => {
  it('drawsOnePathAndLegendEntryPerNonEmptySeries', () => {
    const svg = renderCdf('fork latency', [
      { name: 'fork_same_host_1', samples: [120, 150, 180] },
      { name: 'fork_cross_host_1', samples: [300, 420] },
      { name: 'skipped', samples: [] },
    ]);
    wellFormed(svg);
    expect(svg.match(/<path /g)?.length).toBe(2);
    expect(svg).toContain('fork_same_host_1 (n=3)');
    expect(svg).toContain('fork_cross_host_1 (n=2)');
    expect(svg).not.toContain('skipped');
  });

  it('withNoSamples_saysSo', () => {
    const svg = renderCdf('empty', []);
    wellFormed(svg);
    expect(svg).toContain('no samples');
  });

  it('escapesTitles', () => {
    expect(renderCdf('a<b & "c"', [])).toContain('a&lt;b &amp; &quot;c&quot;');
    expect(escapeXml('<>')).toBe('&lt;&gt;');
  });
});

describe('logTicks', () => {
  it('coversTheRangeWithDecades', () => {
    const t = logTicks(35, 42_000);
    expect(t[0]).toBe(10);
    expect(t[t.length - 1]).toBe(100_000);
  });
});

describe('renderBars', () => {
  it('drawsABarPerValueWithItsLabel', () => {
    const svg = renderBars('same vs cross', 'p50 ms', [
      { label: 'N=1', bars: [{ name: 'same_host', value: 800 }, { name: 'cross_host', value: 1200 }] },
      { label: 'N=4', bars: [{ name: 'same_host', value: 2000 }] },
    ]);
    wellFormed(svg);
    expect(svg.match(/<rect [^>]*><title>/g)?.length).toBe(3);
    expect(svg).toContain('>1200<');
    expect(svg).toContain('N=4');
  });
});
