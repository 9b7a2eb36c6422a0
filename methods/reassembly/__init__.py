"""What pFedClub and pFedHR share (not a method of its own): block pools, features, CKA, grouping, stitching, fine-
tuning, teacher programs."""
