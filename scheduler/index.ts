// Public API of the pure placement library. See README.md for the pipeline and cost model.
export type * from './types.ts';
export { place, estimateAssignment, MAX_FORK_COUNT, type AssignmentEstimate } from './place.ts';
export { buildFleetView, vmConfigFault } from './view.ts';
export { rngForRequest, xoshiro128ss, type Rng } from './rng.ts';
export { DEFAULT_PLACEMENT_CONFIG, compilePlacementConfig, type PlacementConfig } from './config.ts';
export { vmmCompatible, sameBaseImage, compareVersions } from './feasibility.ts';
export { NoCapacityError, UnknownSnapshotError, placementError } from './errors.ts';
