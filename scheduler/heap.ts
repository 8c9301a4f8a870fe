/** Binary min-heap over a comparator. Invariant: less(items[parent], items[child]) or equal for every pair. */
export class MinHeap<T> {
  private readonly items: T[] = [];
  constructor(private readonly less: (a: T, b: T) => boolean) {}

  get size(): number {
    return this.items.length;
  }

  peek(): T | undefined {
    return this.items[0];
  }

  push(x: T): void {
    const a = this.items;
    a.push(x);
    let i = a.length - 1;
    while (i > 0) {
      const p = (i - 1) >> 1;
      const pi = a[p] as T;
      if (!this.less(x, pi)) break;
      a[i] = pi;
      i = p;
    }
    a[i] = x;
  }

  pop(): T | undefined {
    const a = this.items;
    const top = a[0];
    const last = a.pop();
    if (a.length === 0 || last === undefined) return top;
    let i = 0;
    const n = a.length;
    while (true) {
      const l = 2 * i + 1;
      if (l >= n) break;
      const r = l + 1;
      let c = l;
      if (r < n && this.less(a[r] as T, a[l] as T)) c = r;
      const ci = a[c] as T;
      if (!this.less(ci, last)) break;
      a[i] = ci;
      i = c;
    }
    a[i] = last;
    return top;
  }
}
