"""Running things on this machine, for the demo, the tests and the benchmarks: free ports,
waiting, a runtime child process, and the one traffic generator. Loopback addresses only."""
