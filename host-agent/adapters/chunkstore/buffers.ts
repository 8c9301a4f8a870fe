// Ownership hints for chunk buffers on the transfer hot path, so bytes are not copied when
// nobody else can see them. Both are opt-in marks set by the code that allocated the buffer;
// an unmarked buffer is always treated as shared (copied, never detached or written).
//
// - owned: the whole ArrayBuffer belongs to one chunk; a consumer may *transfer* it to a
//   worker thread (detaching it). The peer client marks each received message's buffer
//   (grpc-js allocates one per message); FsChunkStore.accept then verifies on a worker.
// - headroom: the bytes of the ArrayBuffer before the view are scratch; a serializer may
//   write a message header there and send header + data without copying the data.
//   FsChunkStore.getEncoded marks the buffer it read the chunk file into.
// - recyclable: the buffer comes from a pool and goes back once its bytes were copied out.
//   FsChunkStore.getEncodedForSend reads chunk files into pooled buffers; the wire
//   serializer calls `recycleAfterCopy` (grpc-js copies the message right after serializing
//   it, synchronously). A buffer never recycled is simply garbage-collected.

const owned = new WeakSet<ArrayBufferLike>();
const recyclers = new WeakMap<ArrayBufferLike, () => void>();
const headroom = new WeakSet<ArrayBufferLike>();

/** Declares that `data`'s whole ArrayBuffer belongs to one chunk and may be handed off (detached). */
export function markOwned(data: Uint8Array): void {
  owned.add(data.buffer);
}

export function isOwned(data: Uint8Array): boolean {
  return owned.has(data.buffer) && !(data.buffer instanceof SharedArrayBuffer);
}

/** Declares the bytes before `data` (in its ArrayBuffer) scratch space. */
export function markHeadroom(data: Uint8Array): void {
  headroom.add(data.buffer);
}

/** How many scratch bytes precede `data` (0 unless marked). */
export function headroomOf(data: Uint8Array): number {
  return headroom.has(data.buffer) ? data.byteOffset : 0;
}

/** Declares that `data`'s buffer goes back to a pool through `release` (see recycleAfterCopy). */
export function markRecyclable(data: Uint8Array, release: () => void): void {
  recyclers.set(data.buffer, release);
}

/**
 * Returns `data`'s buffer to its pool once the current synchronous work is done: the caller
 * promises that nothing reads `data` after that (the bytes are copied before then).
 */
export function recycleAfterCopy(data: Uint8Array): void {
  const release = recyclers.get(data.buffer);
  if (!release) return;
  recyclers.delete(data.buffer);
  queueMicrotask(release);
}
