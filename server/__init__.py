"""The round machinery: the coordinator (the one round loop), the fleet, the clock, registration, the run log, plots,
bounds on uploads, and the Strategy base whose registry the methods (methods/, fedge.plugins) fill."""
