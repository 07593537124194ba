// nmeter stands in for busybox's nmeter applet, which Debian's busybox (the stand-in images'
// base) lacks: Kubernetes' node e2e specs take a millisecond timestamp from
// `nmeter -d0 '%3t' | head -n1`. Only the time directive is supported: `%t`, `%Nt` is the time
// of day with N fractional digits; other text is copied. -dMS is the delay between lines.
package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

func line(format string, now time.Time) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 >= len(format) {
			b.WriteByte(c)
			continue
		}
		j := i + 1
		digits := 0
		for j < len(format) && format[j] >= '0' && format[j] <= '9' {
			digits = digits*10 + int(format[j]-'0')
			j++
		}
		if j < len(format) && format[j] == 't' {
			b.WriteString(now.Format("15:04:05"))
			if digits > 0 {
				if digits > 9 {
					digits = 9
				}
				frac := fmt.Sprintf("%09d", now.Nanosecond())
				b.WriteString("." + frac[:digits])
			}
			i = j
			continue
		}
		b.WriteByte(c)
	}
	return b.String()
}

func main() {
	delay := time.Second
	format := ""
	for _, a := range os.Args[1:] {
		if strings.HasPrefix(a, "-d") {
			ms, err := strconv.Atoi(strings.TrimPrefix(a, "-d"))
			if err != nil {
				fmt.Fprintln(os.Stderr, "nmeter: bad delay", a)
				os.Exit(1)
			}
			delay = time.Duration(ms) * time.Millisecond
			continue
		}
		format = a
	}
	for {
		if _, err := fmt.Println(line(format, time.Now())); err != nil {
			return
		}
		time.Sleep(delay)
	}
}
