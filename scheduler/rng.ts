// Deterministic random numbers for placement. The seed is a hash of the request id, so a
// decision can be replayed from (view, request) alone.

export interface Rng {
  /** Uniform integer in [0, 2^32). */
  nextU32(): number;
  /** Uniform float in [0, 1). */
  nextFloat(): number;
  /** Uniform integer in [0, n). n must be a positive integer. */
  nextInt(n: number): number;
}

/** cyrb53-style 53-bit string hash, split into two 32-bit halves. */
function hash64(s: string): [number, number] {
  let h1 = 0xdeadbeef;
  let h2 = 0x41c6ce57;
  for (let i = 0; i < s.length; i++) {
    const ch = s.charCodeAt(i);
    h1 = Math.imul(h1 ^ ch, 2654435761);
    h2 = Math.imul(h2 ^ ch, 1597334677);
  }
  h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507) ^ Math.imul(h2 ^ (h2 >>> 13), 3266489909);
  h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507) ^ Math.imul(h1 ^ (h1 >>> 13), 3266489909);
  return [h1 >>> 0, h2 >>> 0];
}

/** splitmix32: expands one word into well-mixed seed words. */
function splitmix32(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x9e3779b9) >>> 0;
    let z = s;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
    return (z ^ (z >>> 16)) >>> 0;
  };
}

/** xoshiro128** over four 32-bit words. Invariant: the state is never all zero. */
export function xoshiro128ss(a: number, b: number, c: number, d: number): Rng {
  let s0 = a >>> 0;
  let s1 = b >>> 0;
  let s2 = c >>> 0;
  let s3 = d >>> 0;
  if ((s0 | s1 | s2 | s3) === 0) s0 = 1;
  const nextU32 = (): number => {
    const r = Math.imul(rotl(Math.imul(s1, 5), 7), 9) >>> 0;
    const t = s1 << 9;
    s2 ^= s0;
    s3 ^= s1;
    s1 ^= s2;
    s0 ^= s3;
    s2 ^= t;
    s3 = rotl(s3, 11);
    return r;
  };
  return {
    nextU32,
    nextFloat: () => nextU32() / 4294967296,
    nextInt: (n: number) => Math.floor((nextU32() / 4294967296) * n),
  };
}

function rotl(x: number, k: number): number {
  return (x << k) | (x >>> (32 - k));
}

/** The RNG place() should be given for a request: seeded from its id. */
export function rngForRequest(requestId: string): Rng {
  const [h1, h2] = hash64(requestId);
  const sm = splitmix32(h1 ^ Math.imul(h2, 0x9e3779b1));
  return xoshiro128ss(sm(), sm(), sm() ^ h2, sm());
}
