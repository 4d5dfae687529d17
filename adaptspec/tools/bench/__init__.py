"""`adaptspec bench`: real vLLM servers side by side on one workload (`run`), the cell where
speculation does not pay (`nopay`), the workload and its prompt sources (`workload`), the
streaming client (`client`), engine steps recovered from chunk times (`steps`) and the
simulator's calibration against a run (`calibrate`)."""
