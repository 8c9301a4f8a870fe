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
  /** The heap's order: when a full-size copy from here would be done (uplinkFreeAtMs + snapshot / uplink). */
  key: number;
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

/** Per view and snapshot: its holders that can serve, in the pool's order for a first copy (see servingOrder). */
const servingOrders = new WeakMap<FleetView, Map<string, Int32Array>>();

/**
 * The snapshot's holders that can serve, by when a full copy from each would be done
 * (snapshotBytes / uplink, then index): the heap's order before any transfer. Computed
 * once per view and snapshot and shared by every decision on that view.
 */
function servingOrder(view: FleetView, snapshotId: string, snapshotBytes: number, holders: readonly number[]): Int32Array {
  let byView = servingOrders.get(view);
  if (byView === undefined) servingOrders.set(view, (byView = new Map()));
  let order = byView.get(snapshotId);
  if (order === undefined) {
    const cols = view.cols;
    const key = (i: number): number => (snapshotBytes * 1000) / (cols.uplink[i] as number);
    order = Int32Array.from(holders.filter((i) => canServe(cols, i)).sort((a, b) => key(a) - key(b) || a - b));
    byView.set(snapshotId, order);
  }
  return order;
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
    maxCommits: number,
  ) {
    this.cols = view.cols;
    this.heap = new MinHeap<Source>((a, b) => a.key < b.key || (a.key === b.key && a.index < b.index));
    // A holder not yet used keeps its first key, so holders are first used in servingOrder's
    // order: `maxCommits` commits (and the estimates before each) use only its first maxCommits.
    const order = servingOrder(view, snapshotId, snapshotBytes, holders);
    for (let k = 0; k < Math.min(order.length, maxCommits); k++) this.heap.push(this.source(order[k] as number, 0, 0));
  }

  private source(index: number, readyAtMs: number, wave: number): Source {
    const uplinkBytesPerS = this.cols.uplink[index] as number;
    return { index, readyAtMs, uplinkBytesPerS, wave, uplinkFreeAtMs: readyAtMs, key: readyAtMs + (this.snapshotBytes * 1000) / uplinkBytesPerS, served: 0 };
  }

  get empty(): boolean {
    return this.heap.size === 0;
  }

  /** When the best source now (the one estimate() would use) holds the bytes; Infinity if there is none. */
  nextReadyAtMs(): number {
    return this.heap.peek()?.readyAtMs ?? Number.POSITIVE_INFINITY;
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
    s.key = s.uplinkFreeAtMs + (this.snapshotBytes * 1000) / s.uplinkBytesPerS;
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
    if (canServe(this.cols, dest)) this.heap.push(this.source(dest, est.readyAtMs, t.wave));
    return t;
  }
}
