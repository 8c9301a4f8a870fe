// For tests of input validation: which field a call's error names (InvalidArgumentError.field).

/** The `field` of the error `f` throws; undefined when it throws none or one without a field. */
export function fieldOf(f: () => unknown): string | undefined {
  try {
    f();
  } catch (e) {
    return (e as { field?: string }).field;
  }
  return undefined;
}
