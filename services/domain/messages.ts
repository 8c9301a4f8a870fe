// The scheduler <-> host-agent protocol messages. These are the protobuf-es types of
// proto/forkfleet/v1/hostwork.proto used as plain data: the protocol is internal and
// versioned with the code, so a second hand-written model of every message would only add
// a conversion layer that can drift. Encoding to bytes happens in adapters/nats only.
export type {
  HostWork as HostWorkMsg,
  HostResult as HostResultMsg,
  Heartbeat as HeartbeatMsg,
  HostEvent as HostEventMsg,
  HostExecRequest as HostExecRequestMsg,
  HostExecOutput as HostExecOutputMsg,
  HostFileRequest as HostFileRequestMsg,
  HostFileResponse as HostFileResponseMsg,
  VmSpec as VmSpecMsg,
} from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
export {
  HostWorkSchema,
  HostResultSchema,
  HostWorkBatchSchema,
  HostResultBatchSchema,
  HeartbeatSchema,
  HostEventSchema,
  HostExecRequestSchema,
  HostExecCancelSchema,
  HostExecAliveSchema,
  HostExecOutputSchema,
  HostFileRequestSchema,
  HostFileResponseSchema,
  VmSpecSchema,
} from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
