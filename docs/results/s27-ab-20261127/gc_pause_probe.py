"""Max collector pause per generation while 1.5 M tracked objects are kept (a heap growing, as a
backlog fills the dedupe window and in-flight state), for several thresholds."""
import gc, time
def probe(th, n_long=1_500_000):
    gc.collect(); gc.set_threshold(*th)
    pauses = {0: 0.0, 1: 0.0, 2: 0.0}
    t0 = [0.0]
    def cb(phase, info):
        if phase == "start": t0[0] = time.perf_counter()
        else:
            g = info["generation"]; pauses[g] = max(pauses[g], time.perf_counter() - t0[0])
    gc.callbacks.append(cb)
    keep = []
    for i in range(n_long):
        keep.append([i])
        if i % 10 == 0:
            junk = [(j,) for j in range(5)]
    gc.callbacks.remove(cb)
    del keep
    gc.collect()
    gc.set_threshold(700, 10, 10)
    return {g: round(p * 1e3, 1) for g, p in pauses.items()}
for th in [(700, 10, 10), (50000, 20, 100), (50000, 10, 10), (50000, 2, 10)]:
    print(th, "max pause ms by generation:", probe(th))
