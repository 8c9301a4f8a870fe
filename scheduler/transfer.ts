// Transfer planning: names a source for each destination that lacks the snapshot, caps
// fan-out per source, and lets destinations serve onward once their copy is complete
// (a tree; DESIGN.md decision 4).
//
// Bandwidth model (fluid, never revised): a source's available uplink is
// bandwidth - txLoad. Transfers from one source run concurrently from the moment the
// source holds the bytes. A transfer can go no faster than min(uplink, destination's
// available downlink), and the uplink must carry every byte assigned to it so far, so the
// k-th destination of a source is ready at
//   max(sourceReady + bytes_k / min(uplink, downlink_k),  sourceReady + (bytes_1 + ... + bytes_k) / uplink).
// For k equal copies over a saturated uplink this is the finish time fair sharing gives the
// last of them; adding a transfer never revises an earlier estimate, so children's ETAs
// stay fixed once computed.
//
// Source choice: the source that would finish a full-size copy first
// (uplinkFreeAt + snapshotBytes / uplink). Exact for full-size copies over uplink-bound
// links; an approximation for partial holders and downlink-bound destinations.
import { MinHeap } from './heap.ts';
import type { FleetView, HostColumns, Transfer } from './types.ts';

interface Source {
  readonly index: number;
  /** When this host holds every byte (0 for original holders). Its transfers start then. */
  readonly readyAtMs: number;
  readonly uplinkBytesPerS: number;
  /** 0 for original holders; k for a host that received its copy in wave k. */
  readonly wave: number;
  /** readyAtMs + (bytes assigned so far) / uplink: when the uplink has carried them all. */
  uplinkFreeAtMs: number;
  served: number;
}

export interface TransferEstimate {
  readonly source: Source;
  readonly startMs: number;
  readonly readyAtMs: number;
}

/** Whether host i may serve bytes to peers (cordoned and draining hosts still may). */
export function canServe(cols: HostColumns, i: number): boolean {
  return cols.state[i] === 0 && (cols.uplink[i] as number) > 0;
}

export class SourcePool {
  private readonly heap: MinHeap<Source>;
  private readonly cols: HostColumns;
  readonly transfers: Transfer[] = [];

  constructor(
    private readonly snapshotId: string,
    private readonly snapshotBytes: number,
    private readonly maxFanOut: number,
    private readonly view: FleetView,
    holders: readonly number[],
  ) {
    const cols = view.cols;
    this.cols = cols;
    const key = (s: Source): number => s.uplinkFreeAtMs + (this.snapshotBytes * 1000) / s.uplinkBytesPerS;
    this.heap = new MinHeap<Source>((a, b) => {
      const ka = key(a);
      const kb = key(b);
      return ka < kb || (ka === kb && a.index < b.index);
    });
    for (const i of holders) {
      if (canServe(cols, i)) this.heap.push({ index: i, readyAtMs: 0, uplinkBytesPerS: cols.uplink[i] as number, wave: 0, uplinkFreeAtMs: 0, served: 0 });
    }
  }

  get empty(): boolean {
    return this.heap.size === 0;
  }

  /** When `dest` would hold `bytes` if it were assigned to the best source now; null if there is no source. */
  estimate(dest: number, bytes: number): TransferEstimate | null {
    const s = this.heap.peek();
    if (s === undefined) return null;
    const rate = Math.min(s.uplinkBytesPerS, this.cols.downlink[dest] as number);
    const startMs = s.readyAtMs;
    const readyAtMs = Math.max(startMs + (bytes * 1000) / rate, s.uplinkFreeAtMs + (bytes * 1000) / s.uplinkBytesPerS);
    return { source: s, startMs, readyAtMs };
  }

  /** estimate(dest, bytes)?.readyAtMs without allocating; Infinity if there is no source. */
  readyAtIfOpened(dest: number, bytes: number): number {
    const s = this.heap.peek();
    if (s === undefined) return Number.POSITIVE_INFINITY;
    const rate = Math.min(s.uplinkBytesPerS, this.cols.downlink[dest] as number);
    return Math.max(s.readyAtMs + (bytes * 1000) / rate, s.uplinkFreeAtMs + (bytes * 1000) / s.uplinkBytesPerS);
  }

  /** Assigns dest to the best source (as estimate() said) and makes dest a source for later waves. */
  commit(dest: number, bytes: number): Transfer | null {
    const est = this.estimate(dest, bytes);
    if (est === null) return null;
    const s = est.source;
    this.heap.pop();
    s.served++;
    s.uplinkFreeAtMs += (bytes * 1000) / s.uplinkBytesPerS;
    if (s.served < this.maxFanOut) this.heap.push(s);
    const t: Transfer = {
      snapshotId: this.snapshotId,
      sourceHostId: this.view.hosts[s.index]?.id ?? '',
      destinationHostId: this.view.hosts[dest]?.id ?? '',
      bytes,
      wave: s.wave + 1,
      startMs: est.startMs,
      readyAtMs: est.readyAtMs,
    };
    this.transfers.push(t);
    if (canServe(this.cols, dest)) {
      this.heap.push({ index: dest, readyAtMs: est.readyAtMs, uplinkBytesPerS: this.cols.uplink[dest] as number, wave: t.wave, uplinkFreeAtMs: est.readyAtMs, served: 0 });
    }
    return t;
  }
}
