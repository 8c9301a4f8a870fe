// Cost-model and search parameters, compiled once into a frozen object (CONVENTIONS.md §6).
// The service reads these from its own config; the library only validates them.
import { InvalidArgumentError } from '../proto/errors.ts';

export interface PlacementConfig {
  /**
   * Private working set of a fork child as a fraction of its guest memory. The memory image
   * itself is shared page cache (one per host per snapshot). Measured: ~48 MiB extra RSS per
   * 256 MiB child, so 48/256 = 0.1875.
   */
  readonly privateMemoryFraction: number;
  /** Restore cost when the view has no per-host measurement. */
  readonly restoreCostMs: number;
  /** Cold boot cost of a create (no snapshot). */
  readonly bootCostMs: number;
  /**
   * Added per queued/in-flight op on the host, and per sibling placed before on it, when the
   * host reports no restoreCostMs and restoreSlots (whose quotient is used instead).
   */
  readonly perOpQueueMs: number;
  /** Weight of host utilisation (0..1) after the child. */
  readonly loadWeightMs: number;
  /** SPREAD: per sibling already on the host. */
  readonly spreadPenaltyMs: number;
  /** PACK: weight of the host's free fraction before the plan (fuller hosts score better). */
  readonly packWeightMs: number;
  /** Max destinations one source serves in a plan. */
  readonly maxFanOut: number;
  /** Fleets larger than this are sampled (power-of-k) instead of scanned. */
  readonly samplingThreshold: number;
  /** Non-holder hosts to sample: max(sampleK, sampleFactor * count) feasible ones. */
  readonly sampleK: number;
  readonly sampleFactor: number;
  /** Give up sampling after this many draws per wanted host. */
  readonly sampleAttemptsPerHost: number;
}

export const DEFAULT_PLACEMENT_CONFIG: PlacementConfig = Object.freeze({
  privateMemoryFraction: 48 / 256,
  restoreCostMs: 150,
  bootCostMs: 1500,
  perOpQueueMs: 40,
  loadWeightMs: 100,
  spreadPenaltyMs: 50,
  packWeightMs: 200,
  maxFanOut: 4,
  samplingThreshold: 256,
  sampleK: 64,
  sampleFactor: 2,
  sampleAttemptsPerHost: 8,
});

/** Validates and freezes. Throws InvalidArgumentError naming the field. */
export function compilePlacementConfig(raw: Partial<PlacementConfig> = {}): PlacementConfig {
  const c: PlacementConfig = { ...DEFAULT_PLACEMENT_CONFIG, ...raw };
  const nonNeg = (field: keyof PlacementConfig): void => {
    const v = c[field];
    if (!Number.isFinite(v) || v < 0) throw new InvalidArgumentError(`placement.${field}`, `must be a finite number >= 0, got ${v}`);
  };
  const posInt = (field: keyof PlacementConfig): void => {
    const v = c[field];
    if (!Number.isInteger(v) || v < 1) throw new InvalidArgumentError(`placement.${field}`, `must be an integer >= 1, got ${v}`);
  };
  for (const f of ['restoreCostMs', 'bootCostMs', 'perOpQueueMs', 'loadWeightMs', 'spreadPenaltyMs', 'packWeightMs', 'sampleFactor'] as const) nonNeg(f);
  for (const f of ['maxFanOut', 'samplingThreshold', 'sampleK', 'sampleAttemptsPerHost'] as const) posInt(f);
  if (!(c.privateMemoryFraction > 0 && c.privateMemoryFraction <= 1)) {
    throw new InvalidArgumentError('placement.privateMemoryFraction', `must be in (0, 1], got ${c.privateMemoryFraction}`);
  }
  return Object.freeze(c);
}
