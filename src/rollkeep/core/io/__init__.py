"""Layer 1, the seams to the outside: the filesystem (`fs`: every read, write, fsync and rename a
run makes, replaceable by the simulation's and the tests' faulty filesystems) and bounded
parsing of files a run did not write itself (`untrusted`)."""
