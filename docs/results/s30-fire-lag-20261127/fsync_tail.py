"""fdatasync tail of small appends (2,000 bytes, every 2 ms) for N seconds, optionally beside
another process appending buffered to other files at R MB/s (RocksDB's WAL, consume queues),
with or without sync_file_range(WRITE) after each MiB (RocksDB's wal_bytes_per_sync)."""
import ctypes, os, sys, time, multiprocessing as mp, tempfile
libc = ctypes.CDLL("libc.so.6", use_errno=True)
SYNC_FILE_RANGE_WRITE = 2
def writer(d, stop, mbps, srf):
    fd = os.open(os.path.join(d, "other"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    chunk = b"w" * 4096; n = 0; t0 = time.monotonic(); last = 0
    while not stop.is_set():
        os.write(fd, chunk); n += 1
        if srf and (n * 4096) - last >= (1 << 20):
            libc.sync_file_range(fd, ctypes.c_longlong(last), ctypes.c_longlong(n * 4096 - last), SYNC_FILE_RANGE_WRITE)
            last = n * 4096
        dt = n * 4096 / (mbps * 1e6) - (time.monotonic() - t0)
        if dt > 0: time.sleep(dt)
def main():
    root, seconds, mbps, srf = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "srf"
    d = tempfile.mkdtemp(dir=root); stop = mp.Event(); p = None
    if mbps:
        p = mp.Process(target=writer, args=(d, stop, mbps, srf)); p.start()
    pre = len(sys.argv) > 5 and sys.argv[5] == "prezeroed"
    if pre:  # written with zeros and synced first: later writes change no block map and no size
        fd = os.open(os.path.join(d, "log"), os.O_WRONLY | os.O_CREAT, 0o644)
        z = b"\0" * (1 << 20)
        for _ in range(256): os.write(fd, z)
        os.fsync(fd); os.lseek(fd, 0, 0)
    else:
        fd = os.open(os.path.join(d, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    lat = []; end = time.monotonic() + seconds; slow = []
    while time.monotonic() < end:
        os.write(fd, b"r" * 2000)
        t = time.monotonic(); os.fdatasync(fd); x = (time.monotonic() - t) * 1000; lat.append(x)
        if x > 50: slow.append(round(x))
        time.sleep(0.002)
    stop.set(); p and p.join()
    lat.sort(); q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]
    print(f"{seconds:.0f} s, other writer {mbps} MB/s{' +sync_file_range/MiB' if srf else ''}{' log pre-zeroed' if pre else ''}: {len(lat)} fdatasyncs, p50 {q(.5):.2f} "
          f"p99 {q(.99):.2f} p999 {q(.999):.2f} max {lat[-1]:.1f} ms; over 50 ms: {slow}", flush=True)
main()
