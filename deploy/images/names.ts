// The guest images a host can build (deploy/images/build.ts has their recipes). Kept apart
// from build.ts so the scheduler can check an image name without loading the builder.
export const IMAGE_NAMES = ['tiny', 'debian'] as const;

export type ImageName = (typeof IMAGE_NAMES)[number];
