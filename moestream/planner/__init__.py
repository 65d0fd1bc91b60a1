"""`moestream plan`: speed, TTFT, sequences and cost predicted from headers and a calibrated machine model."""
