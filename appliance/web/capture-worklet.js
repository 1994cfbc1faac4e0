// The microphone's samples (mono, at the AudioContext's rate) handed to the page as they arrive.
class Capture extends AudioWorkletProcessor {
  process(inputs) {
    const channel = inputs[0][0];
    if (channel) this.port.postMessage(channel.slice(0));
    return true;
  }
}

registerProcessor("capture", Capture);
