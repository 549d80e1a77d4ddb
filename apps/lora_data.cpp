// lora-data: dataset tools (being written).
int main() { return 0; }
