// Named errors of the host agent (CONVENTIONS.md §5). Each extends ForkfleetError with a kind
// and whether a retry may help. Map to gRPC status only at the gRPC edge.
import { ForkfleetError, type ForkfleetErrorOptions } from '../proto/errors.ts';

export { InvalidArgumentError } from '../proto/errors.ts';

/** The QEMU process of a VM exited without being asked to (crash, OOM kill, kill -9). */
export class VmCrashedError extends ForkfleetError {
  readonly vmId: string;
  constructor(vmId: string, detail: string, options: ForkfleetErrorOptions = {}) {
    super('unavailable', `vm ${vmId} crashed: ${detail}`, { retryable: false, ...options });
    this.vmId = vmId;
  }
}

// VmNotFoundError, InvalidVmStateError and VmStillSnapshottingError texts are matched by the
// scheduler (services/domain/fleet.ts vmNotRunning; services/domain/vm-refusals.test.ts).
export class VmNotFoundError extends ForkfleetError {
  constructor(vmId: string) {
    super('not_found', `vm ${vmId} not found`);
  }
}

export class VmAlreadyExistsError extends ForkfleetError {
  constructor(vmId: string) {
    super('already_exists', `vm ${vmId} already exists`);
  }
}

/** The VM's lifecycle state does not allow the operation (e.g. exec on a paused VM). */
export class InvalidVmStateError extends ForkfleetError {
  constructor(vmId: string, state: string, operation: string) {
    super('failed_precondition', `vm ${vmId} is ${state}; cannot ${operation}`);
  }
}

/** A guest call (exec, file) that waited its time for a snapshot of the VM to end: it may pass. */
export class VmStillSnapshottingError extends ForkfleetError {
  constructor(vmId: string, waitedMs: number, operation: string) {
    super('unavailable', `vm ${vmId} is still being snapshotted after ${waitedMs} ms; cannot ${operation} yet`, { retryable: true });
  }
}

/**
 * A drain's pause (PauseVmWork.unless_calls) refused while exec or file calls run in the VM:
 * the drain waits for them to end, for a grace, then pauses it all the same. `field` names the
 * condition, so the scheduler tells this refusal from any other.
 */
export class CallsRunningError extends ForkfleetError {
  constructor(sandboxId: string, calls: number) {
    super('failed_precondition', `sandbox ${sandboxId} has ${calls} call(s) running (exec or file); not paused for the move yet`, { retryable: false, field: 'unless_calls' });
  }
}

/** QEMU did not start, did not reach its ready marker, or refused a command. */
export class VmmError extends ForkfleetError {
  constructor(message: string, options: ForkfleetErrorOptions = {}) {
    super('internal', message, options);
  }
}

export class VmBootTimeoutError extends ForkfleetError {
  constructor(vmId: string, ms: number, options: ForkfleetErrorOptions = {}) {
    // What stopped it (a failed qemu-img, a full disk, a health check) travels with the message:
    // the cause is not part of the step's result.
    const why = options.cause instanceof Error ? `: ${options.cause.message}` : '';
    super('deadline_exceeded', `vm ${vmId} did not become ready within ${ms} ms${why}`, options);
  }
}

/** A QMP command returned an error object. */
export class QmpCommandError extends ForkfleetError {
  readonly qmpClass: string;
  constructor(command: string, qmpClass: string, desc: string) {
    super('internal', `QMP ${command} failed: ${qmpClass}: ${desc}`, { retryable: false });
    this.qmpClass = qmpClass;
  }
}

export class QmpTimeoutError extends ForkfleetError {
  constructor(what: string, ms: number) {
    super('deadline_exceeded', `QMP ${what} timed out after ${ms} ms`);
  }
}

/** The QMP or guest-agent socket closed (QEMU exited, or the connection was dropped). */
export class ChannelClosedError extends ForkfleetError {
  constructor(channel: string, options: ForkfleetErrorOptions = {}) {
    super('unavailable', `${channel} connection closed`, options);
  }
}

export class GuestAgentTimeoutError extends ForkfleetError {
  constructor(command: string, ms: number) {
    super('deadline_exceeded', `guest agent ${command} timed out after ${ms} ms`);
  }
}

export class GuestAgentCommandError extends ForkfleetError {
  constructor(command: string, desc: string) {
    super('internal', `guest agent ${command} failed: ${desc}`, { retryable: false });
  }
}

/** The guest's chmod of a file just written failed (WriteFile with a mode). */
export class GuestChmodError extends ForkfleetError {
  constructor(path: string, mode: number, exitCode: number, stderr: string) {
    super('failed_precondition', `chmod ${mode.toString(8)} ${path} in the guest failed (exit ${exitCode}): ${stderr.trim().slice(0, 200)}`, { retryable: false, field: 'mode' });
  }
}

/** A clone failed its hygiene step (reseed, clock, identity, health check) and is not handed out. */
export class CloneHygieneError extends ForkfleetError {
  constructor(vmId: string, step: string, options: ForkfleetErrorOptions = {}) {
    super('internal', `vm ${vmId}: clone hygiene step ${step} failed`, options);
  }
}

export interface CompatDifference {
  field: string;
  snapshot: string | number;
  host: string | number;
}

/** A snapshot cannot be restored here: machine, memory, vcpus, devices, QEMU, accel or CPU differ. */
export class IncompatibleSnapshotError extends ForkfleetError {
  readonly differences: readonly CompatDifference[];
  constructor(snapshotId: string, differences: readonly CompatDifference[]) {
    const what = differences.map((d) => `${d.field} (snapshot ${d.snapshot}, host ${d.host})`).join('; ');
    super('failed_precondition', `snapshot ${snapshotId} is incompatible with this host: ${what}`, { retryable: false });
    this.differences = differences;
  }
}

export class SnapshotNotFoundError extends ForkfleetError {
  constructor(where: string) {
    super('not_found', `no complete snapshot at ${where}`);
  }
}

/** A snapshot cannot be deleted while VMs still map its files. */
export class SnapshotInUseError extends ForkfleetError {
  constructor(snapshotId: string, users: readonly string[]) {
    super('failed_precondition', `snapshot ${snapshotId} is in use by ${users.join(', ')}`);
  }
}

export class KvmUnavailableError extends ForkfleetError {
  constructor(reason: string) {
    super('failed_precondition', `accel kvm unavailable: ${reason}`, { retryable: false });
  }
}

export class ImageBuildError extends ForkfleetError {
  constructor(name: string, detail: string, options: ForkfleetErrorOptions = {}) {
    super('internal', `image ${name} build failed: ${detail}`, options);
  }
}

/** The host lacks something the agent needs to set up (a cgroup hierarchy, a mount); says what. */
export class HostSetupError extends ForkfleetError {
  constructor(message: string, options: ForkfleetErrorOptions = {}) {
    super('failed_precondition', message, { retryable: false, ...options });
  }
}

/**
 * System errors that pass (GC frees the disk, other work closes its files, a disk answers
 * again), by errno code, with the kind they are answered as.
 */
const PASSING_ERRNO: Readonly<Record<string, 'resource_exhausted' | 'unavailable'>> = {
  ENOSPC: 'resource_exhausted',
  EDQUOT: 'resource_exhausted',
  EMFILE: 'resource_exhausted',
  ENFILE: 'resource_exhausted',
  ENOMEM: 'resource_exhausted',
  EAGAIN: 'unavailable',
  EBUSY: 'unavailable',
  EIO: 'unavailable',
};

/**
 * `what` failed with a system error that may pass: retryable, so a host step meeting it is
 * journalled for that send only and the scheduler's retry runs it again, and a peer's fetch
 * tries the source again. Its message names the errno code only: the error's own text names
 * host paths, and a named kind's text reaches tenants.
 */
export class PassingSystemError extends ForkfleetError {
  constructor(what: string, code: string, kind: 'resource_exhausted' | 'unavailable', cause: unknown) {
    super(kind, `${what} failed with ${code} on the host; it may pass (a retry runs it again)`, { retryable: true, cause });
  }
}

/** `e` as a PassingSystemError when it is a system error of a code that passes (not a ForkfleetError); else undefined. */
export function passingSystemError(e: unknown, what: string): PassingSystemError | undefined {
  if (e instanceof ForkfleetError) return undefined;
  const code = (e as { code?: unknown } | null)?.code;
  const kind = typeof code === 'string' ? PASSING_ERRNO[code] : undefined;
  return kind && typeof code === 'string' ? new PassingSystemError(what, code, kind, e) : undefined;
}
