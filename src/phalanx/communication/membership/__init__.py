"""Who is in the job: the rendezvous store, elastic membership, beacons."""
